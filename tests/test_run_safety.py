"""Run safety in real 2-process ZeRO-3 launches: no hang, no orphan, one writer per directory, and a resume that
loads only what was saved for this run. Each test here failed (or hung) before the fix it guards."""

import contextlib
import json
import re
import shutil
import signal
import time

import psutil
import pytest

from recipes.telemetry.metrics import read_metrics
from tests.conftest import (
    LAUNCH_ENV,
    REFERENCE_RUN,
    REPO,
    launch,
    launch_command,
    start,
    tiny_overrides,
    train_losses,
)

pytestmark = pytest.mark.multiprocess

PRETRAIN = REPO / "recipes/pretrain.py"
MODEL_WAS_BUILT = "parameters; this rank holds"


def run_args(corpus, output_dir, **extra):
    """The session's reference run (tests/conftest.py), with `extra` on top."""
    return tiny_overrides(corpus, output_dir, **{**REFERENCE_RUN, **extra})


def no_recipe_traceback(stderr: str) -> bool:
    """The ranks reported the cause in one line, not a traceback through the recipe's code (the launcher's own
    ChildFailedError report is another matter)."""
    return not any(f'File "{REPO / package}' in stderr for package in ("recipes", "common", "data_prep", "eval"))


@pytest.fixture(scope="module")
def finished(reference_run):
    """The session's uninterrupted 16-step run, with checkpoint-12 and checkpoint-16."""
    return reference_run


def at_step_12(finished, destination):
    """The finished run as it was when checkpoint-12 was its newest."""
    shutil.copytree(finished, destination, ignore=shutil.ignore_patterns("checkpoint-16", "final"))
    (destination / "latest").write_text("checkpoint-12\n")
    return destination


def process_tree(root_pid):
    root = psutil.Process(root_pid)
    return [root, *root.children(recursive=True)]


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_for_training(log_path, process, timeout_s=300):
    deadline = time.time() + timeout_s
    while "INFO pretrain: loss" not in log_path.read_text():
        assert process.poll() is None, log_path.read_text()[-3000:]
        assert time.time() < deadline, "training did not start"
        time.sleep(0.2)


def test_killing_the_launcher_alone_ends_every_process_of_the_launch(tmp_path, corpus):
    log_path = tmp_path / "log.txt"
    with open(log_path, "w") as log:
        launcher = start(launch_command(PRETRAIN, run_args(corpus, tmp_path / "run", max_steps=400)),
                         stdout=log, stderr=log)  # fmt: skip
        wait_for_training(log_path, launcher)
        tree = process_tree(launcher.pid)
        assert len(tree) >= 5, "launcher, 2 ranks, their dataloader workers"
        launcher.send_signal(signal.SIGKILL)  # the launcher only: the ranks have sessions of their own
        launcher.wait()
    deadline = time.time() + 20
    survivors = tree[1:]
    while survivors and time.time() < deadline:
        survivors = [p for p in survivors if alive(p)]
        time.sleep(0.2)
    for orphan in survivors:  # leave nothing behind, whatever the verdict
        with contextlib.suppress(psutil.Error):
            orphan.kill()
    assert not survivors, f"still running 20 s after the launcher died: {[p.cmdline()[-3:] for p in survivors]}"


def test_a_second_launch_into_a_live_run_stops_and_names_the_holder(tmp_path, corpus):
    output_dir = tmp_path / "run"
    log_path = tmp_path / "first.txt"
    with open(log_path, "w") as log:
        first = start(launch_command(PRETRAIN, run_args(corpus, output_dir, max_steps=24)), stdout=log, stderr=log)
        wait_for_training(log_path, first)
        second = launch(PRETRAIN, run_args(corpus, output_dir, max_steps=24))
        assert first.wait(timeout=600) == 0, log_path.read_text()[-3000:]
    assert second.returncode != 0
    assert "is in use by another training run (host" in second.stderr and "pid" in second.stderr
    assert MODEL_WAS_BUILT not in second.stderr and no_recipe_traceback(second.stderr)
    steps = [r["step"] for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 25)), "the live run is unharmed: one history, no step twice"


def test_a_stalled_data_source_exits_5_and_a_hang_elsewhere_exits_1_with_every_stack(tmp_path, corpus):
    """The documented exit codes, as the ranks return them (torchrun's failure summary names each rank's; `accelerate
    launch` itself exits 1 when any rank fails). A stuck dataloader worker is named after half of hang_timeout_s
    (5); with no workers the same stall is a hang in the rank itself, which the watchdog ends (1). A short timeout
    (12 s): every second of it is waited twice."""
    env = {**LAUNCH_ENV, "PRETRAIN_TEST_STALL_WORKER_AFTER_ROWS": "40"}
    stalled = launch(PRETRAIN, run_args(corpus, tmp_path / "stalled", max_steps=400, hang_timeout_s=12,
                                        dataloader_num_workers=1), env=env, timeout_s=400)  # fmt: skip
    assert stalled.returncode != 0
    assert re.search(r"exitcode\s*:\s*5\b", stalled.stderr), stalled.stderr[-3000:]
    assert "the dataloader workers produced no batch in 6 s (half of hang_timeout_s)" in stalled.stderr
    # the process group waits longer than both (DeepSpeed's default 600 s came before the 900 s and 1800 s defaults)
    assert "collectives: a rank gives up after 612.0 s in one (hang_timeout_s + 600 s" in stalled.stderr
    hung = launch(PRETRAIN, run_args(corpus, tmp_path / "hung", max_steps=400, hang_timeout_s=12,
                                     dataloader_num_workers=0), env=env, timeout_s=400)  # fmt: skip
    assert hung.returncode != 0 and re.search(r"exitcode\s*:\s*1\b", hung.stderr), hung.stderr[-3000:]
    assert "Timeout (0:00:12)!" in hung.stderr and "most recent call first" in hung.stderr


def corrupt(path, offset=4096, size=8192):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        original = handle.read(size)
        handle.seek(offset)
        handle.write(bytes(255 - b for b in original))


def test_a_resume_through_what_real_directories_collect_is_exact(tmp_path, finished, corpus):
    """One resume through three things that each used to stop or hang it, in one launch:
    - a corrupted shard in the newest checkpoint: skipped for the previous one, naming the file (an explicit
      `--resume` to it is refused by name, before the model);
    - a torn last line of metrics.jsonl (a kill in the middle of a write): dropped with a warning;
    - TOKENIZERS_PARALLELISM=true exported: the relaunch forks dataloader workers after tokenizing the validation
      set, and with the Rust tokenizer's thread pool started the forked workers deadlocked in encode_batch (a hang
      is killed whole after 300 s and fails the test)."""
    from recipes.training.checkpointing import CheckpointError, find_resume_checkpoint, verify_checksums

    output_dir = tmp_path / "run"
    shutil.copytree(finished, output_dir, ignore=shutil.ignore_patterns("final"))
    shard = next((output_dir / "checkpoint-16" / "pytorch_model").glob("*optim_states.pt"))
    size = shard.stat().st_size
    corrupt(shard)
    assert shard.stat().st_size == size
    with pytest.raises(CheckpointError) as refused:
        find_resume_checkpoint(output_dir, str(output_dir / "checkpoint-16"), verify_checksums)
    assert shard.name in str(refused.value) and "sha256" in str(refused.value)
    with open(output_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 9, "lo')
    env = {**LAUNCH_ENV, "TOKENIZERS_PARALLELISM": "true"}
    resumed = launch(PRETRAIN, run_args(corpus, output_dir), env=env, timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipped checkpoint-16: {shard}" in resumed.stderr and "checkpoint-12 at step 12" in resumed.stderr
    # set aside, not deleted and not counted by rotation as one of the checkpoints it keeps; the run saved step 16 anew
    assert "set checkpoint-16 aside as checkpoint-16.damaged" in resumed.stderr
    assert (output_dir / "checkpoint-16.damaged" / "pytorch_model" / shard.name).is_file()
    assert verify_checksums(output_dir / "checkpoint-16") == []
    assert "is not a metrics record (torn by a kill?); dropped" in resumed.stderr
    assert train_losses(output_dir) == train_losses(finished), "resumed from checkpoint-12, bit-exact to the end"


def test_a_fresh_start_into_a_used_directory_is_refused_unless_asked_to_overwrite(tmp_path, finished, corpus):
    output_dir = tmp_path / "run"
    shutil.copytree(finished, output_dir)
    (output_dir / "notes.txt").write_text("mine")
    refused = launch(PRETRAIN, [*run_args(corpus, output_dir, max_steps=4), "--resume", "none"])
    assert refused.returncode != 0 and "overwrite_output_dir" in refused.stderr
    assert MODEL_WAS_BUILT not in refused.stderr and (output_dir / "checkpoint-16").exists()
    fresh = launch(PRETRAIN, [*run_args(corpus, output_dir, max_steps=4, overwrite_output_dir="true"), "--resume",
                              "none"])  # fmt: skip
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-4"]
    assert [r["step"] for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    assert (output_dir / "notes.txt").read_text() == "mine", "only the run's own outputs are removed"


def test_a_changed_run_definition_is_refused_before_the_model_is_built(tmp_path, finished, corpus):
    output_dir = at_step_12(finished, tmp_path / "run")
    result = launch(PRETRAIN, [*run_args(corpus, output_dir), "--max_seq_length", "64"])
    assert result.returncode != 0 and re.search(r"exitcode\s*:\s*2\b", result.stderr), result.stderr[-3000:]
    assert "run-defining values differ" in result.stderr and "max_seq_length: 128 -> 64" in result.stderr
    assert MODEL_WAS_BUILT not in result.stderr and no_recipe_traceback(result.stderr)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (["--model_config.num_hidden_layers", "2"], "model_shape.num_hidden_layers: 4 -> 2"),
        (["--gradient_accumulation_steps", "1", "--global_batch_size", "16"], "global_batch_rows: 32 -> 16"),
    ],
)
def test_every_run_defining_change_is_named(finished, corpus, change, named):
    """The comparison the launch above refuses by, for the other run-defining values (no launch needed: it reads the
    checkpoint's resolved recipe and this one's)."""
    from transformers import AutoTokenizer

    from recipes.config import load_config
    from recipes.training.model import llama_config
    from recipes.training.resume import identity_changes, run_identity, saved_identity

    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    config = load_config(REPO / "recipes/configs/tiny_cpu.yaml", [*run_args(corpus, finished)[2:], *change])
    current = run_identity(config, llama_config(config, len(tokenizer)), tokenizer, 2)
    changes = identity_changes(saved_identity(finished / "checkpoint-12", tokenizer), current)
    assert len(changes) == 1 and changes[0].startswith(named)


def test_too_little_training_data_is_an_error_not_an_untrained_model(tmp_path, corpus):
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "def f(): return 1"}) + "\n")
    result = launch(PRETRAIN, run_args(corpus, tmp_path / "run", train_files=tiny))
    assert result.returncode != 0, result.stderr[-3000:]
    assert "the data ended before the first optimizer step" in result.stderr
    assert not (tmp_path / "run" / "final").exists()

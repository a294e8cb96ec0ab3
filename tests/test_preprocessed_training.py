"""Training on a cleaned and preprocessed directory under real 2-process ZeRO-3, with 2 dataloader workers per rank
and document masking: a relaunch in a fresh process continues with exactly the batches an uninterrupted
run draws, and a checkpoint whose data position is reset does not."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from data_prep.preprocessing.pipeline import preprocess
from recipes.training.checkpointing import read_manifest
from tests.conftest import LAUNCH_ENV, REPO, data_position, forge_data_position, launch, tiny_overrides, train_losses

pytestmark = pytest.mark.multiprocess

STEPS = 12


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory, corpus):
    """The corpus through the three data stages: cleaned (data_prep.clean: the unknown-character filter and MinHash
    dedup, as the Python sources it holds are not prose for the word-based filters), preprocessed, then trained on."""
    root = tmp_path_factory.mktemp("packed")
    config = root / "clean.yaml"
    config.write_text("filters: {unknown_characters: {}}\n")
    cleaned = subprocess.run([sys.executable, "-m", "data_prep.clean", "--input", str(corpus["train"]), "--output",
                              str(root / "cleaned"), "--config", str(config), "--workers", "2"],
                             cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert cleaned.returncode == 0, cleaned.stderr[-3000:]
    shards = sorted(str(path) for path in (root / "cleaned" / "data").glob("*.jsonl.zst"))
    manifest = preprocess(str(corpus["tokenizer"]), shards, str(root / "train"), 128, 2, rows_per_shard=500)
    kept = json.loads((root / "cleaned" / "clean_report.json").read_text())["output"]["docs"]
    assert manifest["num_documents"] == kept > 0
    return root / "train"


def run_args(corpus, packed_dir, output_dir, **extra):
    # fp32: an elastic run then equals an uninterrupted one to 1e-6, so any difference a world-size change carries
    # besides the order of the sums shows (bf16 rounding would hide one of 2e-5: docs/slurm.md)
    values = dict(train_files=packed_dir, max_steps=STEPS, save_steps=6, logging_steps=1, eval_steps=6,
                  max_eval_samples=16, warmup_steps=3, dataloader_num_workers=2, document_masking="true",
                  bf16="false")  # fmt: skip
    return tiny_overrides(corpus, output_dir, **{**values, **extra})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus, packed_dir):
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    result = launch(REPO / "recipes/pretrain.py", run_args(corpus, packed_dir, output_dir))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "preprocessed rows" in result.stderr
    assert sorted(train_losses(output_dir)) == list(range(1, STEPS + 1))
    return output_dir


def resume_from_step_6(tmp_path, uninterrupted, corpus, packed_dir, reset_position: bool):
    output_dir = tmp_path / "resumed"
    shutil.copytree(uninterrupted, output_dir)
    shutil.rmtree(output_dir / f"checkpoint-{STEPS}")
    shutil.rmtree(output_dir / "final")
    position = data_position(output_dir / "checkpoint-6")
    assert position["kind"] == "preprocessed"
    assert position["global_rows_consumed"] == 6 * 32  # steps x global batch
    if reset_position:
        forge_data_position(output_dir / "checkpoint-6", lambda position: position.update(global_rows_consumed=0))
    result = launch(REPO / "recipes/pretrain.py", run_args(corpus, packed_dir, output_dir))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "checkpoint-6 at step 6" in result.stderr
    return train_losses(output_dir)


def test_relaunch_draws_exactly_the_uninterrupted_batches(tmp_path, uninterrupted, corpus, packed_dir):
    assert resume_from_step_6(tmp_path, uninterrupted, corpus, packed_dir, reset_position=False) == train_losses(
        uninterrupted
    )


def test_negative_control_with_the_position_reset_diverges(tmp_path, uninterrupted, corpus, packed_dir):
    expected = train_losses(uninterrupted)
    train = resume_from_step_6(tmp_path, uninterrupted, corpus, packed_dir, reset_position=True)
    assert all(train[s] == expected[s] for s in range(1, 7))
    assert all(train[s] != expected[s] for s in range(7, STEPS + 1))


def test_a_lost_node_and_its_return_continue_the_run_unattended(tmp_path, uninterrupted, corpus, packed_dir):
    """elastic: 2 processes -> 1 (a node lost) -> 2 (it is back), each start converting the other world size's
    checkpoint to the universal format itself and keeping the global batch (accumulation 2 -> 4 -> 2). Every step is
    trained once, on exactly the uninterrupted run's rows, with losses equal up to summation order (in fp32)."""
    import subprocess

    from recipes.telemetry.metrics import read_metrics
    from tests.conftest import kill_whole_tree, launch_command, start

    output_dir = tmp_path / "elastic"
    shutil.copytree(uninterrupted, output_dir)
    shutil.rmtree(output_dir / f"checkpoint-{STEPS}")
    shutil.rmtree(output_dir / "final")
    args = run_args(corpus, packed_dir, output_dir, elastic="true", save_steps=3)
    log_path = tmp_path / "one_node.log"
    with open(log_path, "w") as log:  # on one node until that one is lost too, right after its checkpoint-9
        job = start(launch_command(REPO / "recipes/pretrain.py", args, num_processes=1), stdout=log,
                    stderr=subprocess.STDOUT)  # fmt: skip
        while job.poll() is None and not (output_dir / "checkpoint-9" / "manifest.json").exists():
            time.sleep(0.02)
        kill_whole_tree(job.pid)
        job.wait(timeout=60)
    one_node = log_path.read_text()
    finished = (output_dir / f"checkpoint-{STEPS}").exists()
    assert (output_dir / "checkpoint-9").exists() and not finished, one_node[-3000:]
    assert "elastic: 1 processes, gradient_accumulation_steps 4 (global batch 32 rows)" in one_node
    assert "elastic: converting checkpoint-6 to DeepSpeed's universal format" in one_node
    assert "world size 2 -> 1 at step 6: gradient_accumulation_steps 2 -> 4" in one_node
    assert read_manifest(output_dir / "checkpoint-9")["world_size"] == 1

    both = launch(REPO / "recipes/pretrain.py", args)
    assert both.returncode == 0, both.stderr[-4000:]
    assert "elastic: converting checkpoint-9" in both.stderr and "world size 1 -> 2 at step 9" in both.stderr
    expected, train = train_losses(uninterrupted), train_losses(output_dir)
    steps = [r["step"] for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, STEPS + 1)), "no step repeated or skipped"
    assert train[7] == pytest.approx(expected[7], rel=1e-6), "same model and same rows at the first step"
    # the universal load once gave the norms the weights' weight decay: 2.3e-5 apart in fp32 (summation order: 6e-8)
    assert all(train[s] == pytest.approx(expected[s], rel=1e-6) for s in range(8, STEPS + 1)), (train, expected)
    assert read_manifest(output_dir / f"checkpoint-{STEPS}")["world_size"] == 2
    assert data_position(output_dir / f"checkpoint-{STEPS}")["global_rows_consumed"] == STEPS * 32
    report = (output_dir / "report.md").read_text()
    assert ("world size changes (global batch kept): step 6: 2 -> 1 ranks (accumulation 2 -> 4); "
            "step 9: 1 -> 2 ranks (accumulation 4 -> 2)") in report  # fmt: skip


def test_a_rollback_after_a_world_size_change_loads_this_launchs_checkpoint(tmp_path, uninterrupted, corpus,
                                                                            packed_dir):  # fmt: skip
    """A launch that resumed from another world size's checkpoint builds its engine to load DeepSpeed's universal
    format; a rollback to a checkpoint this launch saved (the ordinary format) went through that loader too. Each
    load now says which format it reads."""
    output_dir = tmp_path / "elastic"
    shutil.copytree(uninterrupted, output_dir)
    shutil.rmtree(output_dir / f"checkpoint-{STEPS}")
    shutil.rmtree(output_dir / "final")
    args = run_args(corpus, packed_dir, output_dir, elastic="true", save_steps=2, loss_spike_factor=0.98,
                    loss_spike_window=3, loss_spike_action="rollback", loss_spike_max_rollbacks=1)  # fmt: skip
    result = launch(REPO / "recipes/pretrain.py", args, num_processes=1)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "elastic: converting checkpoint-6 to DeepSpeed's universal format" in result.stderr
    rolled = [line for line in result.stderr.splitlines() if "rolling back to checkpoint-" in line]
    assert rolled and not rolled[0].endswith("checkpoint-6"), result.stderr[-4000:]
    assert read_manifest(output_dir / f"checkpoint-{STEPS}")["world_size"] == 1


def test_another_world_size_without_elastic_names_both_ways_out(tmp_path, uninterrupted, corpus, packed_dir):
    """Checked where a launch checks it, before the model (no launch needed to see the answer)."""
    from transformers import AutoTokenizer

    from recipes.config import load_config
    from recipes.training.checkpointing import CheckpointError
    from recipes.training.model import llama_config
    from recipes.training.resume import check_resumable, run_identity
    from recipes.training.train_data import TrainData, open_train_source
    from tests.conftest import TINY_RECIPE

    config = load_config(TINY_RECIPE, run_args(corpus, packed_dir, tmp_path, gradient_accumulation_steps=4)[2:])
    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    data = TrainData(open_train_source(config, tokenizer, 1), config, tokenizer, rank=0, world=1)
    identity = run_identity(config, llama_config(config, len(tokenizer)), tokenizer, 1)
    checkpoint = uninterrupted / "checkpoint-6"
    try:
        with pytest.raises(CheckpointError) as refused:
            check_resumable(checkpoint, identity, tokenizer, data, 1)
    finally:
        data.close()  # its dataloader workers ignore SIGTERM: left alone they would keep pytest from exiting
    assert "set elastic: true (with global_batch_size) to convert it at start" in str(refused.value)
    assert f"ds_to_universal --input_folder {checkpoint}/pytorch_model" in str(refused.value)
    assert f"--output_folder {checkpoint}/.universal.manual/pytorch_model && mv" in str(refused.value), "staged"


def test_raw_text_positions_cannot_move_to_another_world_size(tmp_path, corpus, reference_run):
    """The session's raw-text run (2 processes) resumed on 1: refused, naming the way out (checked where a launch
    checks it, before the model; no launch needed to see the answer)."""
    from transformers import AutoTokenizer

    from recipes.config import load_config
    from recipes.training.checkpointing import read_trainer_state
    from recipes.training.train_data import TrainData, open_train_source
    from tests.conftest import TINY_RECIPE

    args = tiny_overrides(corpus, tmp_path / "raw", max_steps=20, gradient_accumulation_steps=4)
    config = load_config(TINY_RECIPE, args[2:])
    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    data = TrainData(open_train_source(config, tokenizer, 1), config, tokenizer, rank=0, world=1)
    problem = data.resume_problem(read_trainer_state(reference_run / "checkpoint-16")["data_position"])
    assert "raw-text data position is per rank" in problem and "data_prep.preprocess" in problem


def test_export_reads_the_universal_form_when_the_rank_shards_are_gone(tmp_path, uninterrupted, corpus, monkeypatch):
    """A checkpoint kept only in its universal form (after a world-size change) still exports, to the same weights;
    the conversion the recipe runs itself (elastic) replaces what a killed or failed one left, and its files are on
    storage (synced) before the listing that marks it complete."""
    import os

    from safetensors.torch import load_file

    from recipes.export import export_checkpoint
    from recipes.training import elastic
    from recipes.training.universal import has_universal

    checkpoint = tmp_path / "checkpoint-6"
    shutil.copytree(uninterrupted / "checkpoint-6", checkpoint)
    # what a conversion killed half-way, and one that failed, leave: nothing a start trusts, removed by the next
    (checkpoint / elastic.STAGING / "pytorch_model" / "zero").mkdir(parents=True)
    (checkpoint / elastic.FAILED).write_text("an earlier failure")
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    ensure_universal(checkpoint)
    assert has_universal(checkpoint) and not list(checkpoint.glob(f"{elastic.STAGING}*"))
    staging = Path(next(path for path in synced if path.endswith("/.conversion.json.tmp"))).parent
    assert staging.name.startswith(f"{elastic.STAGING}-"), "a staging directory of this conversion's own"
    listed = synced.index(str(staging / ".conversion.json.tmp"))
    converted = [str(staging / p.relative_to(checkpoint / "universal"))
                 for p in (checkpoint / "universal").rglob("*") if p.name != "conversion.json"]  # fmt: skip
    assert converted and set(converted) <= set(synced[:listed]) and synced[-1] == str(checkpoint)
    # the listing names the start that converted: a waiting rank whose file system lags takes no earlier one for it
    attempt = json.loads((checkpoint / "universal" / "conversion.json").read_text())["attempt"]
    assert elastic.converted_by(checkpoint, attempt) and not elastic.converted_by(checkpoint, "an earlier start")
    assert not (checkpoint / elastic.FAILED).exists()
    from_shards = export_checkpoint(checkpoint, tmp_path / "from_shards", dtype="float32")
    for shard in (checkpoint / "pytorch_model").glob("*optim_states.pt"):
        shard.unlink()
    from_universal = export_checkpoint(checkpoint, tmp_path / "from_universal", dtype="float32")
    ours, theirs = load_file(from_shards / "model.safetensors"), load_file(from_universal / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


class OneProcess:
    """The part of an Accelerator that elastic.ensure_universal uses, for one process."""

    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass


def ensure_universal(checkpoint) -> None:
    """elastic.ensure_universal in one process, re-hashing universal/ as a resume does."""
    from recipes.training import elastic
    from recipes.training.universal import verify_universal_share

    elastic.ensure_universal(checkpoint, OneProcess(), lambda path: verify_universal_share(path, 0, 1))


def test_a_failed_conversion_publishes_nothing_and_every_rank_says_why(tmp_path, uninterrupted):
    from recipes.training import elastic
    from recipes.training.checkpointing import CheckpointError
    from recipes.training.universal import has_universal

    checkpoint = tmp_path / "checkpoint-6"
    shutil.copytree(uninterrupted / "checkpoint-6", checkpoint)
    for shard in (checkpoint / "pytorch_model").glob("*model_states.pt"):
        shard.write_bytes(b"truncated")  # a shard damaged after its manifest was checked
    with pytest.raises(CheckpointError, match="elastic: converting .*checkpoint-6 to the universal format failed"):
        ensure_universal(checkpoint)
    assert not has_universal(checkpoint) and not list(checkpoint.glob(f"{elastic.STAGING}*"))
    with pytest.raises(CheckpointError, match="to the universal format failed"):  # a rank that waited for rank 0
        elastic.wait_for_conversion(checkpoint)
    # a node whose file system still shows an earlier start's marker waits for this start's outcome
    import threading

    earlier = json.loads((checkpoint / elastic.FAILED).read_text())
    assert earlier["attempt"] and "to the universal format failed" in earlier["message"]
    later = threading.Timer(0.5, lambda: (checkpoint / elastic.FAILED).write_text(
        json.dumps({"attempt": "this start", "message": "this start's own failure"})))  # fmt: skip
    later.start()
    with pytest.raises(CheckpointError, match="^this start's own failure$"):
        elastic.wait_for_conversion(checkpoint, "this start")
    later.join()


def test_data_that_ends_before_max_steps_still_gets_its_last_step_evaluated_saved_and_exported(tmp_path, corpus):
    """A run whose data ends before max_steps is told at start how many steps one pass gives, and stops at the last
    of them with that step's validation, checkpoint and final/ (before, it stopped without any of them)."""
    small = tmp_path / "small.jsonl"
    with open(corpus["train"]) as source:
        small.write_text("".join(line for _, line in zip(range(5), source, strict=False)))
    manifest = preprocess(str(corpus["tokenizer"]), [str(small)], str(tmp_path / "packed"), 128, 1)
    steps_per_pass = manifest["num_sequences"] // 32  # global batch: 2 ranks x 8 rows x 2 accumulation (tiny recipe)
    assert 2 <= steps_per_pass < 20, manifest["num_sequences"]
    output_dir = tmp_path / "run"
    args = tiny_overrides(corpus, output_dir, train_files=tmp_path / "packed", max_steps=20, eval_steps=15,
                          save_steps=15, logging_steps=1, max_eval_samples=8, warmup_steps=2)  # fmt: skip
    result = launch(REPO / "recipes/pretrain.py", args)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"one pass is {steps_per_pass} optimizer steps, so num_train_epochs 1 gives {steps_per_pass} of the " \
           f"run's 20: the run stops at step {steps_per_pass} (end of data)" in result.stderr  # fmt: skip
    from tests.conftest import eval_losses

    assert sorted(train_losses(output_dir)) == list(range(1, steps_per_pass + 1))
    assert list(eval_losses(output_dir)) == [steps_per_pass]
    assert (output_dir / f"checkpoint-{steps_per_pass}" / "manifest.json").exists()
    summary = json.loads((output_dir / "run_summary.json").read_text())
    assert summary["steps"] == steps_per_pass and summary["stop_reason"].startswith("end of data")
    assert json.loads((output_dir / "final" / "export.json").read_text())["step"] == steps_per_pass


def test_a_damaged_or_empty_universal_form_is_set_aside_and_converted_again(tmp_path, uninterrupted):
    """Issue 37: one parameter folder missing from universal/ (a conversion by hand cut short) gave a DeepSpeed
    traceback, exit 1, on every relaunch; an empty universal/pytorch_model (killed at its start) made the relaunch's
    own conversion fail to publish ('Directory not empty'), every time. Both are found, kept aside, converted again;
    with the rank shards gone too, the problem is named in one line."""
    from common.files import sha256_of
    from recipes.training import elastic
    from recipes.training.checkpointing import UNIVERSAL_DIR, CheckpointError
    from recipes.training.universal import has_universal, universal_problems, verify_universal_share

    checkpoint = tmp_path / "checkpoint-6"
    shutil.copytree(uninterrupted / "checkpoint-6", checkpoint)
    (checkpoint / UNIVERSAL_DIR / "pytorch_model").mkdir(parents=True)  # killed at its start
    assert not has_universal(checkpoint) and "is missing or empty" in universal_problems(checkpoint)[0]
    ensure_universal(checkpoint)
    assert has_universal(checkpoint) and (checkpoint / elastic.DAMAGED).is_dir()

    zero = checkpoint / UNIVERSAL_DIR / "pytorch_model" / "zero"
    shutil.rmtree(zero / "model.layers.1.mlp.up_proj.weight")  # one parameter lost from a finished conversion
    assert universal_problems(checkpoint)[0].endswith("model.layers.1.mlp.up_proj.weight/exp_avg.pt is missing")
    (checkpoint / UNIVERSAL_DIR / "conversion.json").unlink()  # as a conversion by hand leaves it: no listing
    assert universal_problems(checkpoint) == [
        f"{zero}/model.layers.1.mlp.up_proj.weight/{state} is missing" for state in ("fp32.pt", "exp_avg.pt",
                                                                                      "exp_avg_sq.pt")
    ]  # fmt: skip
    ensure_universal(checkpoint)
    assert has_universal(checkpoint) and not universal_problems(checkpoint)

    # a file changed in place, its size kept (a bit flip on the storage): only its sha256 tells
    listing = json.loads((checkpoint / UNIVERSAL_DIR / "conversion.json").read_text())["files"]
    changed = zero / "model.layers.1.mlp.up_proj.weight" / "fp32.pt"
    assert listing[str(changed.relative_to(checkpoint / UNIVERSAL_DIR))]["sha256"] == sha256_of(changed)
    data = bytearray(changed.read_bytes())
    data[-16:] = bytes(255 - b for b in data[-16:])
    changed.write_bytes(bytes(data))
    assert not universal_problems(checkpoint) and verify_universal_share(checkpoint, 0, 1) == [
        f"{changed}: sha256 differs from the conversion's conversion.json (the file was changed or damaged)"
    ]
    ensure_universal(checkpoint)
    # the third copy set aside, beside the two before it (never deleted: someone's only copy, maybe)
    third = checkpoint / f"{elastic.DAMAGED}-3"
    assert (checkpoint / elastic.DAMAGED).is_dir() and (checkpoint / f"{elastic.DAMAGED}-2").is_dir()
    assert verify_universal_share(checkpoint, 0, 1) == [] and (third / changed.relative_to(
        checkpoint / UNIVERSAL_DIR)).read_bytes() == bytes(data), "the damaged copy is kept aside"  # fmt: skip

    shutil.rmtree(zero / "model.layers.0.mlp.up_proj.weight")
    for shard in (checkpoint / "pytorch_model").glob("*optim_states.pt"):
        shard.unlink()
    with pytest.raises(CheckpointError, match="has no ZeRO rank shards left to convert and no loadable universal"):
        ensure_universal(checkpoint)

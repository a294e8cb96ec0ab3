"""`python -m recipes.export` against what real runs do to it: a damaged checkpoint, an output that holds what it
reads, two exports at once, a failure half way. Each case ends in one line, exit code 2, and nothing lost or left."""

import copy
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from common.lock import FileLock
from recipes.config import ConfigError
from recipes.export import export_checkpoint
from recipes.training.checkpointing import export_staging, manifest_problems, verify_checksums
from tests.conftest import LAUNCH_ENV, REPO

pytestmark = pytest.mark.multiprocess  # they read the session's trained run


@pytest.fixture
def run(tmp_path, trained_run):
    """A copy of the session's run, its newest checkpoint and its tokenizer's directory."""
    copy = tmp_path / "run"
    shutil.copytree(trained_run["dir"], copy, ignore=shutil.ignore_patterns("final", "tensorboard"))
    return copy, copy / "checkpoint-40", trained_run["corpus"]["tokenizer"]


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes.export", *map(str, args)], cwd=REPO, env=LAUNCH_ENV,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.glob(".*.tmp"))


def test_a_damaged_shard_is_named_and_nothing_is_written(run, tmp_path):
    _, checkpoint, _ = run
    shard = next((checkpoint / "pytorch_model").glob("*optim_states.pt"))
    data = bytearray(shard.read_bytes())
    data[4096:4104] = bytes(255 - b for b in data[4096:4104])
    shard.write_bytes(bytes(data))
    result = export(checkpoint, "--output", tmp_path / "model")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: cannot export {checkpoint}: {shard}: sha256 differs from the manifest " \
                                    "(the file was changed or damaged)"  # fmt: skip
    assert not (tmp_path / "model").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("where", ["run", "parent", "checkpoint", "inside_checkpoint", "tokenizer"])
def test_overwrite_never_removes_what_the_export_reads(run, where):
    run_dir, checkpoint, tokenizer = run
    output = {"run": run_dir, "parent": run_dir.parent, "checkpoint": checkpoint,
              "inside_checkpoint": checkpoint / "pytorch_model", "tokenizer": tokenizer}[where]  # fmt: skip
    result = export(checkpoint, "--output", output, "--overwrite", "--tokenizer", tokenizer)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert (
        result.stderr.startswith(f"error: --output {output} ") and "choose a directory apart from it" in result.stderr
    )
    assert manifest_problems(checkpoint) == [] and verify_checksums(checkpoint) == []
    assert (tokenizer / "tokenizer.json").exists()


def test_a_second_export_to_the_same_output_is_refused(run, tmp_path):
    _, checkpoint, _ = run
    output = tmp_path / "model"
    with FileLock(tmp_path / ".model.export-lock", what="another export to this --output"):
        result = export(checkpoint, "--output", output)
    assert result.returncode == 2 and "is held by another export to this --output" in result.stderr
    assert not output.exists()
    assert export(checkpoint, "--output", output).returncode == 0, "free again once the first is done"


def test_a_failure_half_way_leaves_no_staging_and_publishes_nothing(run, tmp_path, monkeypatch):
    from recipes import export as export_module

    _, checkpoint, _ = run

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / ".model.tmp" / "model.safetensors"))

    monkeypatch.setattr(export_module, "_write_weights", fail)
    with pytest.raises(ConfigError, match="No space left on device") as raised:
        export_checkpoint(checkpoint, tmp_path / "model")
    assert not (tmp_path / "model").exists() and leftovers(tmp_path) == []
    # the full disk stays findable behind the one line: the training run's final/ export exits 4 on it, not 2 (bad
    # input, which a scheduler does not requeue and a person reads as a mistake in the recipe)
    from common.exit_codes import disk_full

    assert disk_full(raised.value).errno == 28


def test_exporting_an_exported_model_says_what_it_is(trained_run, tmp_path):
    final = trained_run["dir"] / "final"
    result = export(final, "--output", tmp_path / "model")
    assert result.returncode == 2
    assert "is an exported model directory already (export.json): use it as it is" in result.stderr


def test_a_stop_signal_during_the_final_export_abandons_it_and_leaves_nothing(run, monkeypatch):
    """Slurm's preemption sends SIGTERM and, KillWait later (30 s), SIGKILL: a 70B final/ export cannot finish in
    between. It is abandoned at once, its staging removed, the checkpoint untouched, and the run exits as a stopped
    run (the message says how to export it); a relaunch of the finished run exports final/."""
    import signal
    import types

    from recipes import export as export_module

    run_dir, checkpoint, _ = run
    write_weights = export_module._write_weights

    def signalled_half_way(*args, **kwargs):
        write_weights(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # Slurm's preemption, after the weights and before the rest
        time.sleep(5)  # the handler interrupts this; reaching the end is the failure

    monkeypatch.setattr(export_module, "_write_weights", signalled_half_way)
    before = signal.getsignal(signal.SIGTERM)
    signals = types.SimpleNamespace(received=None)
    said = "stop signal .SIGTERM. during the final export: checkpoint-40 is saved and complete; final/ was not written"
    with pytest.raises(export_module.ExportInterrupted, match=said), \
            export_module._abandoned_on_stop_signal(signals, checkpoint, run_dir / "final"):  # fmt: skip
        export_checkpoint(checkpoint, run_dir / "final", overwrite=True, verify=False, run_may_hold_output=True)
    assert signal.getsignal(signal.SIGTERM) is before, "the run's own handler is back"
    assert not (run_dir / "final").exists() and leftovers(run_dir) == []
    assert manifest_problems(checkpoint) == [] and verify_checksums(checkpoint) == []
    # a signal that came before the export (during the final save or evaluation) skips it
    signals.received = signal.SIGUSR1
    with pytest.raises(export_module.ExportInterrupted, match="SIGUSR1. before the final export"), \
            export_module._abandoned_on_stop_signal(signals, checkpoint, run_dir / "final"):  # fmt: skip
        raise AssertionError("the export must not start")


def test_a_killed_exports_staging_is_removed_at_the_next_start(run, trained_run):
    """A SIGKILLed export leaves `.export-final.tmp` (~140 GB at 70B) hidden in the run directory: the run's next start
    removes it unless an export still holds its lock; the next export to the same output removes its own. A killed
    save's `.checkpoint-N.tmp` goes at the next start too (with the space a save needs, the next save would fail)."""
    from recipes.training.output_dir import lock as lock_output_dir
    from recipes.training.output_dir import prepare

    run_dir, checkpoint, _ = run
    staging, lock = export_staging(run_dir / "final")
    (staging / "model").mkdir(parents=True)
    (staging / "model" / "model-00001.safetensors").write_bytes(b"x" * 4096)
    lock.touch()
    beside, beside_lock = export_staging(run_dir / "export-20")
    beside.mkdir()
    killed_save = run_dir / ".checkpoint-7.tmp"  # a save SIGKILLed halfway (at 70B up to ~1 TB)
    (killed_save / "pytorch_model").mkdir(parents=True)
    (killed_save / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x" * 4096)
    config = copy.deepcopy(trained_run["config"])  # the session's: not to be changed
    config.output_dir = str(run_dir)
    held = lock_output_dir(config)  # as a start takes it: the killed save's staging goes now, before any conversion
    assert not killed_save.exists()
    with FileLock(beside_lock, what="a live export"):  # an export beside the checkpoints, still at work
        prepare(config, {}, AutoTokenizer.from_pretrained(trained_run["corpus"]["tokenizer"]))
    held.release()
    assert not staging.exists() and beside.exists()
    elsewhere = run_dir.parent / "model"
    export_staging(elsewhere)[0].mkdir()
    result = export(checkpoint, "--output", elsewhere)
    assert result.returncode == 0, result.stderr
    assert f"removing {export_staging(elsewhere)[0]}, left by an export to {elsewhere} that was killed" in result.stderr
    assert leftovers(run_dir.parent) == []


def test_missing_parents_are_made_and_files_get_the_umask_modes(run, tmp_path):
    """`--output /models/step-4000` where /models does not exist yet, as the README's shared storage; the files are
    readable by the group and others under umask 022, as every other output (the weights were 0600)."""
    _, checkpoint, _ = run
    output = tmp_path / "models" / "shared" / "step-40"
    result = subprocess.run([sys.executable, "-m", "recipes.export", str(checkpoint), "--output", str(output)],
                            cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=300,
                            preexec_fn=lambda: os.umask(0o022))  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    modes = {path.name: path.stat().st_mode & 0o777 for path in [output, *output.iterdir()]}
    assert modes.pop("step-40") == 0o755 and modes["model.safetensors"] == 0o644
    assert set(modes.values()) == {0o644}, modes


def test_a_tokenizer_trained_again_into_the_runs_directory_is_refused_and_a_live_run_exports_its_own(
    run, tmp_path, trained_run, monkeypatch, caplog
):
    """`train_tokenizer --overwrite` into a live run's tokenizer directory once gave final/ a 512-token tokenizer
    beside 1024-row embeddings, exit 0 (issue 37): the run now exports the tokenizer it trained with, and an export
    from disk refuses a tokenizer that is not the run's."""
    from transformers import AutoTokenizer

    from data_prep.tokenizer.training import main as train_tokenizer
    from recipes.config import config_from_dict
    from recipes.export import export_run
    from recipes.training.checkpointing import read_config

    _, checkpoint, tokenizer_dir = run
    replaced = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, replaced)
    original = AutoTokenizer.from_pretrained(replaced)
    train_tokenizer(["--input", str(trained_run["corpus"]["train"]), "--vocab-size", "512", "--output", str(replaced),
                     "--overwrite"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"is not the one checkpoint-40 was trained with .* 512 tokens"):
        export_checkpoint(checkpoint, tmp_path / "out", tokenizer_path=str(replaced))
    assert not (tmp_path / "out").exists()
    said = export(checkpoint, "--output", tmp_path / "out2", "--tokenizer", replaced)
    assert said.returncode == 2 and said.stderr.count("\n") == 1, said.stderr
    # without --tokenizer: the run's own copy, whatever happened to the directory it was loaded from
    kept = checkpoint.parent / "tokenizer"
    assert AutoTokenizer.from_pretrained(kept).get_vocab() == original.get_vocab()
    exported = export_checkpoint(checkpoint, tmp_path / "out3")
    assert json.loads((exported / "export.json").read_text())["tokenizer"] == str(kept.resolve())
    assert AutoTokenizer.from_pretrained(exported).get_vocab() == original.get_vocab()

    # the live run's own export: the tokenizer it loaded at its start, whatever the directory holds now
    config = config_from_dict(read_config(checkpoint), "x")
    config.output_dir, config.tokenizer_name_or_path = str(checkpoint.parent), str(replaced)

    class Stub:  # what export_run uses of the trainer and the launch
        state = type("State", (), {"step": 40, "best_checkpoint": None})()
        accelerator = type("Accelerator", (), {"is_main_process": True})()
        signals = type("Signals", (), {"received": None})()

        def save(self):
            return checkpoint

    launch = type("Launch", (), {"inputs": type("Inputs", (), {"tokenizer": original})()})()
    recorded = []
    import recipes.export as export_module

    monkeypatch.setattr(export_module, "_write_record", lambda *args: recorded.append(args))
    with caplog.at_level("WARNING", logger="pretrain"):
        export_run(config, launch, Stub(), stop=type("Stop", (), {"reason": None})())
    assert f"tokenizer_name_or_path {replaced} no longer holds the tokenizer this run trained with" in caplog.text
    assert len(AutoTokenizer.from_pretrained(checkpoint.parent / "final")) == len(original) == 1024
    assert recorded, "the run's record is written after the export"


def test_an_export_is_on_storage_before_it_takes_its_name(run, tmp_path, monkeypatch):
    """An export was renamed into place unsynced: after a power loss an evaluation could load `model/` whose weights
    never reached the disk. Every file and directory of the staging tree is synced before the rename, and the
    parent directory after it."""
    _, checkpoint, _ = run
    synced, real_fsync = [], os.fsync

    def record(descriptor):
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", record)
    output = export_checkpoint(checkpoint, tmp_path / "model")
    staging = export_staging(tmp_path / "model")[0]
    written = [str(staging / path.relative_to(output)) for path in output.rglob("*")]
    staging_synced_last = len(synced) - 1 - synced[::-1].index(str(staging))
    assert written and set(written) <= set(synced[:staging_synced_last]), "files first, then the directory"
    assert synced[-1] == str(tmp_path), "the rename, last"


def test_a_checkpoint_holds_12_bytes_per_parameter_as_the_planner_says(trained_run):
    """The planner sized a checkpoint as bf16 weights and optimizer state (14 bytes per parameter, 966 GB at 70B);
    ZeRO-3 saves the fp32 master weights and both Adam moments only (its model-states files are kB): 12."""
    from safetensors import safe_open

    from recipes.training.checkpointing import read_manifest

    with safe_open(str(trained_run["dir"] / "final" / "model.safetensors"), "pt") as weights:
        params = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118 (no __iter__)
    files = read_manifest(trained_run["dir"] / "checkpoint-40")["files"]
    saved = sum(entry["bytes"] for name, entry in files.items() if name.startswith("pytorch_model/"))
    assert saved / params == pytest.approx(12, rel=0.02)

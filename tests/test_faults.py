"""Loss spikes (logged, or rolled back with the offending data skipped) and a save that fails for lack of
space, in real 2-process ZeRO-3 runs."""

import re
import resource
import subprocess

import pytest

from recipes.telemetry.metrics import read_metrics
from recipes.training.checkpointing import manifest_problems, verify_checksums
from recipes.training.run_state import LossSpikeRule
from tests.conftest import REPO, data_position, launch_command, start, tiny_overrides

pytestmark = pytest.mark.multiprocess

STEPS = 10
ROWS_PER_STEP_PER_RANK = 16  # micro-batch 8 x accumulation 2


def run(args, limit_bytes=None):
    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    process = start(
        launch_command(REPO / "recipes/pretrain.py", args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=limit_file_size if limit_bytes else None,
    )
    stdout, stderr = process.communicate(timeout=600)
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def spike_args(corpus, output_dir, action):
    # An aggressive rule (a loss above 0.98 x the mean of the last 3 steps) so that a tiny run has spikes.
    return tiny_overrides(
        corpus, output_dir, max_steps=STEPS, save_steps=2, logging_steps=1, eval_steps=100, warmup_steps=2,
        loss_spike_factor=0.98, loss_spike_window=3, loss_spike_action=action, loss_spike_max_rollbacks=1,
    )  # fmt: skip


def test_loss_spikes_are_logged_then_rolled_back_with_the_data_window_skipped(tmp_path, corpus):
    logged = run(spike_args(corpus, tmp_path / "log", "log"))
    assert logged.returncode == 0, logged.stderr[-3000:]
    records = read_metrics(tmp_path / "log" / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    spikes = [r["loss_spike_step"] for r in records if "loss_spike" in r]
    # the rule, replayed on the logged losses, finds exactly the logged spikes
    rule = LossSpikeRule(0.98, 3)
    assert spikes == [step for step in sorted(losses) if rule.check(losses[step]) is not None]
    assert spikes, "the aggressive rule must fire in this run"
    first = spikes[0]

    rolled = run(spike_args(corpus, tmp_path / "rollback", "rollback"))
    assert rolled.returncode == 0, rolled.stderr[-3000:]
    checkpoint = (first - 1) // 2 * 2  # the last save before the spike (saves come after the check)
    assert f"step {first}: loss spike" in rolled.stderr and f"rolling back to checkpoint-{checkpoint}" in rolled.stderr
    records = read_metrics(tmp_path / "rollback" / "metrics.jsonl")
    assert [r["rolled_back_to_step"] for r in records if "rolled_back_to_step" in r] == [checkpoint]
    position = data_position(tmp_path / "rollback" / f"checkpoint-{STEPS}")
    skipped = first - checkpoint  # steps of data between the checkpoint and the spike, not trained on again
    assert [p["rows_consumed"] for p in position["per_rank"]] == [(STEPS + skipped) * ROWS_PER_STEP_PER_RANK] * 2
    # loss_spike_max_rollbacks 1: one rollback, and every spike after it only logged (each rank says each warning)
    found = re.findall(r"step (\d+): loss spike ([\d.]+)[^\n]*; (rolling back|logged only)", rolled.stderr)
    actions = [action for _, _, action in dict.fromkeys(found)]
    assert actions[0] == "rolling back" and actions.count("rolling back") == 1 and len(actions) > 1, found
    # the count is the run's, saved with it: a requeued launch used to start it over, and roll back again and again
    from recipes.training.checkpointing import read_trainer_state

    saved = read_trainer_state(tmp_path / "rollback" / f"checkpoint-{STEPS}")["run_state"]
    assert saved["loss_spike_rollbacks"] == 1


def test_a_save_that_fails_for_lack_of_space_keeps_the_previous_checkpoint(tmp_path, corpus):
    output_dir = tmp_path / "run"
    args = tiny_overrides(corpus, output_dir, max_steps=2, save_steps=2, eval_steps=100, warmup_steps=1)
    first = run(args)
    assert first.returncode == 0, first.stderr[-3000:]
    # the relaunch continues to step 4, where the save hits a 3 MB file-size limit (EFBIG, like a full disk): each
    # rank's optimizer shard (fp32 weights and Adam moments of half the tiny model, ~6 MB) is larger
    shards = list((output_dir / "checkpoint-2" / "pytorch_model").glob("*optim_states.pt"))
    assert len(shards) == 2 and all(shard.stat().st_size > 4 << 20 for shard in shards)
    resumed = run([*args, "--max_steps", "4"], limit_bytes=3 << 20)
    assert resumed.returncode != 0 and re.search(r"exitcode\s*:\s*4\b", resumed.stderr), resumed.stderr[-3000:]
    assert "saving checkpoint-4 failed on rank(s) [0, 1]" in resumed.stderr
    assert "the previous checkpoint (checkpoint-2) is intact" in resumed.stderr
    assert not (output_dir / "checkpoint-4").exists() and not list(output_dir.glob(".checkpoint-*.tmp"))
    assert (output_dir / "latest").read_text().strip() == "checkpoint-2"
    assert manifest_problems(output_dir / "checkpoint-2") == [] and verify_checksums(output_dir / "checkpoint-2") == []


def test_fp16_overflows_are_the_loss_scalers_and_a_non_finite_norm_elsewhere_is_a_fault(caplog, monkeypatch):
    """fp16's dynamic loss scaling overflows by design (early in training, and after each doubling of the scale):
    DeepSpeed skips that update and lowers the scale, but the loop raised a training fault at the first one, so every
    fp16 run stopped (exit 3) within hours. Now an overflow is logged, and only a run of FP16_OVERFLOWS_IN_A_ROW is a
    fault; in bf16 or fp32 the first non-finite gradient norm still is."""
    from recipes.training.run_state import TrainingFault
    from recipes.training.trainer import FP16_OVERFLOWS_IN_A_ROW, loss_scale_overflows

    assert loss_scale_overflows(False, True, 0, 7, None) == 1
    assert "step 7: fp16 loss-scale overflow, the update was skipped" in caplog.text
    assert loss_scale_overflows(True, True, 5, 8, None) == 0, "a finite step ends the streak"
    assert loss_scale_overflows(False, True, FP16_OVERFLOWS_IN_A_ROW - 2, 9, None) == FP16_OVERFLOWS_IN_A_ROW - 1
    with pytest.raises(TrainingFault, match=f"at step 9 \\({FP16_OVERFLOWS_IN_A_ROW} fp16 overflows in a row\\)"):
        loss_scale_overflows(False, True, FP16_OVERFLOWS_IN_A_ROW - 1, 9, "checkpoint-4")
    with pytest.raises(TrainingFault, match="non-finite gradient norm at step 3: stopping without saving. Last good "
                                            "checkpoint: checkpoint-2"):  # fmt: skip
        loss_scale_overflows(False, False, 0, 3, "checkpoint-2")

    # DeepSpeed's own scaler gives up at its minimum scale with a bare Exception: exit 3, not a traceback's 1
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from recipes.training.trainer import fp16_floor_is_a_fault

    # DeepSpeed's defaults for fp16: scale 2^16, hysteresis 2, minimum 1, raise at the minimum
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)  # it logs on rank 0 (no process group here)
    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False, raise_error_at_min_scale=True)  # fmt: skip
    overflows = 0
    floor = "fp16 loss scale at its minimum and still overflowing at step 12"
    with pytest.raises(TrainingFault, match=floor), fp16_floor_is_a_fault(12, "checkpoint-10"):
        for _ in range(40):
            overflows += 1
            scaler.update_scale(True)
    assert overflows > FP16_OVERFLOWS_IN_A_ROW, f"ours comes first: DeepSpeed gives up at overflow {overflows}"
    with pytest.raises(ValueError, match="another error"), fp16_floor_is_a_fault(12, None):
        raise ValueError("another error")

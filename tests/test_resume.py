"""Kill a real 2-process ZeRO-3 run with SIGKILL at an arbitrary moment, relaunch the same command,
and require every logged loss to equal an uninterrupted run's, bit for bit."""

import json
import random
import re
import shutil
import signal
import subprocess
import time

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from recipes.telemetry.metrics import read_metrics
from recipes.training.validation import load_validation_rows
from tests.conftest import (
    LAUNCH_ENV,
    REFERENCE_RUN,
    REPO,
    eval_losses,
    forge_data_position,
    kill_whole_tree,
    launch,
    launch_command,
    start,
    tiny_overrides,
    train_losses,
)

pytestmark = pytest.mark.multiprocess

STEPS = REFERENCE_RUN["max_steps"]


def run_args(corpus, output_dir):
    return tiny_overrides(corpus, output_dir, **REFERENCE_RUN)


def losses(output_dir):
    return train_losses(output_dir), eval_losses(output_dir)


@pytest.fixture(scope="module")
def uninterrupted(reference_run):
    return reference_run


def test_sigkill_anywhere_then_relaunch_is_bit_exact(tmp_path, corpus, uninterrupted):
    output_dir = tmp_path / "killed"
    # a common shell setting that used to deadlock the relaunch's dataloader worker
    env = {**LAUNCH_ENV, "TOKENIZERS_PARALLELISM": "true"}
    command = launch_command(REPO / "recipes/pretrain.py", run_args(corpus, output_dir))
    victim = start(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while not (output_dir / "latest").exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    delay = random.uniform(0.0, 2.5)  # somewhere in the next steps, possibly inside a save
    time.sleep(delay)
    killed = victim.poll() is None
    killed_processes = kill_whole_tree(victim.pid)
    victim.wait()
    assert not killed or killed_processes >= 5, "launcher, 2 ranks and a dataloader worker each"
    published_at_kill = (output_dir / "latest").read_text().strip()

    relaunch = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert relaunch.returncode == 0, relaunch.stderr[-4000:]
    if killed:
        # The newest complete checkpoint: the one `latest` named, or a newer one whose rename landed
        # just before the kill and the pointer update did not.
        resumed = re.search(r"resume: continuing from .*checkpoint-(\d+) at step", relaunch.stderr)
        assert resumed and int(resumed.group(1)) >= int(published_at_kill.split("-")[1])
    expected_train, expected_evals = losses(uninterrupted)
    train, evals = losses(output_dir)
    assert train == expected_train, f"killed {delay:.2f} s after the first checkpoint"
    assert evals == expected_evals
    state = json.loads((output_dir / "run_summary.json").read_text())
    assert state["steps"] == STEPS


def test_negative_control_without_the_data_position_diverges(tmp_path, uninterrupted, corpus):
    """Same checkpoint, data position reset to the start: the losses after the resume must differ,
    which shows the comparison above can fail."""
    output_dir = tmp_path / "reset"
    shutil.copytree(uninterrupted, output_dir)
    shutil.rmtree(output_dir / f"checkpoint-{STEPS}")

    def reset(position):
        for rank_position in position["per_rank"]:
            rank_position["rows_consumed"] = 0

    forge_data_position(output_dir / "checkpoint-12", reset)

    result = launch(REPO / "recipes/pretrain.py", run_args(corpus, output_dir))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resume: continuing from" in result.stderr and "checkpoint-12 at step 12" in result.stderr
    expected_train, _ = losses(uninterrupted)
    train, _ = losses(output_dir)
    assert all(train[s] == expected_train[s] for s in range(1, 13)), "history up to the checkpoint is kept"
    assert all(train[s] != expected_train[s] for s in range(13, STEPS + 1))


def test_a_requested_checkpoint_that_is_incomplete_is_an_error(tmp_path, uninterrupted):
    """Refused while the checkpoint is chosen, before the model (no launch needed to see the answer)."""
    from recipes.training.checkpointing import CheckpointError, find_resume_checkpoint

    broken = tmp_path / "checkpoint-4"
    shutil.copytree(uninterrupted / "checkpoint-12", broken)
    (broken / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="cannot resume from the requested checkpoint.*has no manifest.json"):
        find_resume_checkpoint(tmp_path / "out", str(broken))


RANK_PATTERN = re.search(r"RANK_PATTERN='([^']+)'", (REPO / "scripts/slurm/run.sh").read_text()).group(1)


def stop_when_training(args, output_dir, log_path, how: str) -> int:
    """Launch, and once a loss is logged send the stop signal `how` names; returns the step it saved at."""
    with open(log_path, "w") as log:
        job = start(launch_command(REPO / "recipes/pretrain.py", args), stdout=log, stderr=log)
        deadline = time.time() + 300
        while "INFO pretrain: loss" not in log_path.read_text() and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        if how == "preemption":
            for process in [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]:
                process.send_signal(signal.SIGTERM)  # Slurm's preemption signals every process of the job
        else:  # what scripts/slurm/run.sh does before the time limit, narrowed to this test's run
            subprocess.run(["pkill", "-USR1", "-f", "--", f"{RANK_PATTERN}.*{output_dir}"], check=True)
        job.wait(timeout=120)
    log = log_path.read_text()
    if how == "time limit":  # under preemption torchrun itself is signalled and exits non-zero
        assert job.returncode == 0, log[-3000:]
    assert "stop signal (SIGTERM/SIGUSR1): saved and exited" in log, log[-3000:]
    step = int(re.search(r"training stopped after (\d+) steps", log).group(1))
    assert (output_dir / "latest").read_text().strip() == f"checkpoint-{step}"
    assert not (output_dir / "final").exists(), "a preempted run is continued, not exported"
    return step


def test_a_stop_signal_makes_every_rank_save_and_exit_cleanly(tmp_path, corpus, uninterrupted):
    """USR1 to the ranks (the time limit's save-and-requeue), then SIGTERM to every process (preemption) of the
    relaunch, then a relaunch to the end: each start continues exactly where the signal saved, and the run equals
    an uninterrupted one. The saved checkpoint's data position is that of its step (it used to include the next
    step's batches, taken before the signal was agreed on, so a resume skipped them)."""
    output_dir = tmp_path / "preempted"
    args = run_args(corpus, output_dir)
    first = stop_when_training(args, output_dir, tmp_path / "time_limit.txt", "time limit")
    assert 0 < first < STEPS
    stopped = json.loads((output_dir / "run_summary.json").read_text())  # a stopped run records itself too
    assert stopped["steps"] == first and stopped["stop_reason"].startswith("stop signal") and stopped["launches"] == 1
    assert stopped["exported_from"] is None and (output_dir / "loss.png").exists()
    assert f"- steps: {first} (stop signal" in (output_dir / "report.md").read_text()
    second = stop_when_training(args, output_dir, tmp_path / "preemption.txt", "preemption")
    assert f"checkpoint-{first} at step {first}" in (tmp_path / "preemption.txt").read_text()
    assert first < second < STEPS
    relaunch = launch(REPO / "recipes/pretrain.py", args)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert f"checkpoint-{second} at step {second}" in relaunch.stderr
    assert losses(output_dir) == losses(uninterrupted)
    # report.md says what run_summary.json says, over all three launches (it once gave the last logged step, the
    # last launch's wall time, and another throughput than the plan table's)
    summary, report = json.loads((output_dir / "run_summary.json").read_text()), (output_dir / "report.md").read_text()
    assert summary["steps"] == STEPS and summary["launches"] == 3 and summary["num_tokens"] == STEPS * 32 * 128
    assert summary["wall_seconds"] > stopped["wall_seconds"] + 5, "the earlier launches' time is in it"
    assert f"- steps: {STEPS} (max_steps)" in report and f"- tokens consumed: {summary['num_tokens']:,}" in report
    assert f"- wall time: {summary['wall_seconds']:.0f} s over 3 launches" in report
    assert f"- throughput: {summary['tokens_per_s']:,.0f} tokens/s over all ranks (tokens of the training" in report
    measured = {row["quantity"]: row["measured"] for row in summary["plan_vs_measured"]}
    assert measured["tokens_per_s"] == summary["tokens_per_s"], "one throughput"


def test_early_stopping_exports_the_best_checkpoint(tmp_path, corpus):
    # A learning rate that overshoots: the eval loss falls, then rises (at step 12), and patience 1 stops the run.
    args = tiny_overrides(
        corpus, tmp_path, max_steps=60, eval_steps=4, save_steps=100, logging_steps=4, max_eval_samples=16,
        early_stopping_patience=1, learning_rate="1.0", warmup_steps=0,
    )  # fmt: skip
    result = launch(REPO / "recipes/pretrain.py", args)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if "eval_loss" in r}
    stopped = summary["steps"]
    best = min(evals, key=evals.get)
    assert summary["stop_reason"].startswith("early stopping") and stopped < 60 and best == stopped - 4, evals
    assert summary["best_checkpoint"] == f"checkpoint-{best}"
    assert f"exporting the best checkpoint, checkpoint-{best}, to final/" in result.stderr
    assert (tmp_path / f"checkpoint-{best}").exists() and (tmp_path / f"checkpoint-{stopped}").exists()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32).eval()
    rows = load_validation_rows(
        [str(corpus["validation"])], AutoTokenizer.from_pretrained(tmp_path / "final"), 128, "text", 16
    )
    with torch.no_grad():
        loss = model(input_ids=rows, labels=rows).loss.item()
    assert loss == pytest.approx(evals[best], abs=0.01) and abs(loss - evals[stopped]) > 0.01
    # The same command again (a requeue after a stop signal cut the export, or a crash) stays stopped: it trained on
    # from the early stop's checkpoint before, and exported a later model
    (tmp_path / "final").rename(tmp_path / "final-first")
    again = launch(REPO / "recipes/pretrain.py", args)
    assert again.returncode == 0, again.stderr[-4000:]
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["steps"] == stopped and summary["stop_reason"].startswith("early stopping"), summary
    assert f"exporting the best checkpoint, checkpoint-{best}, to final/" in again.stderr
    # Resumed with another validation set: its losses are not compared with the old set's best (once the new set's
    # first loss "did not improve" on the old set's and the run stopped early, exporting an old checkpoint).
    changed = tmp_path / "validation_reversed.jsonl"
    changed.write_text("".join(reversed(corpus["validation"].read_text().splitlines(keepends=True))))
    args = tiny_overrides(
        corpus, tmp_path, max_steps=stopped + 4, eval_steps=4, save_steps=100, logging_steps=4, max_eval_samples=16,
        early_stopping_patience=1, learning_rate="1.0", warmup_steps=0, validation_files=changed,
    )  # fmt: skip
    resumed = launch(REPO / "recipes/pretrain.py", args)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "validation set changed since the last evaluation" in resumed.stderr
    assert "the old set's best was" in resumed.stderr and f"at checkpoint-{best})" in resumed.stderr
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["steps"] == stopped + 4 and summary["stop_reason"].startswith("max_steps"), summary
    assert summary["best_checkpoint"] == f"checkpoint-{stopped + 4}"


def test_a_blown_up_run_stops_every_rank_without_saving(tmp_path, corpus):
    args = tiny_overrides(
        corpus, tmp_path, max_steps=30, learning_rate="1e4", lr_scheduler_kwargs="{min_lr: 1e4}", warmup_steps=0,
        max_grad_norm="1e9", logging_steps=1, save_steps=1,
    )  # fmt: skip
    result = launch(REPO / "recipes/pretrain.py", args)
    assert result.returncode != 0 and re.search(r"exitcode\s*:\s*3\b", result.stderr), result.stderr[-3000:]
    assert re.search(r"non-finite (loss|gradient norm) at step (\d+)", result.stderr)
    step = int(re.search(r"non-finite (?:loss|gradient norm) at step (\d+)", result.stderr).group(1))
    published = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*"))
    assert all(s < step for s in published), "nothing from the faulty step is saved"
    assert f"Last good checkpoint: {tmp_path / f'checkpoint-{step - 1}'}" in result.stderr or step == 1

"""The real recipe, end to end: `accelerate launch` with 2 CPU processes and DeepSpeed ZeRO-3."""

import json
import math
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.hardware import cpu_has_native_bf16
from recipes.telemetry.metrics import read_metrics
from recipes.training.checkpointing import verify_checksums
from recipes.training.schedule import lr_at_step
from recipes.training.validation import load_validation_rows
from tests.conftest import LAUNCH_ENV, REPO, TINY_RECIPE, data_position, launch, tiny_overrides

pytestmark = pytest.mark.multiprocess

STEPS = 40


@pytest.fixture(scope="module")
def run(trained_run):
    return trained_run


def test_loss_falls_and_metrics_are_complete(run):
    records = read_metrics(run["dir"] / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == list(range(5, STEPS + 1, 5))
    assert [r["step"] for r in evals] == [20, 40]
    for record in train:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_host_memory_gb"} <= set(record)
        assert math.isfinite(record["loss"]) and record["tokens_per_s"] > 0 and record["grad_norm"] > 0
    # Honest accounting: tokens/s times seconds per step is one global batch, not one per rank.
    tokens_per_step = 2 * 8 * 2 * 128  # ranks x micro-batch x accumulation x sequence length
    for record in train:
        assert record["tokens_per_s"] * record["step_time_s"] == pytest.approx(tokens_per_step, rel=1e-6)
        assert 0 <= record["data_wait_s"] < record["step_time_s"], "the wait for batches is part of the step"
    assert train[-1]["num_tokens"] == STEPS * tokens_per_step
    assert train[0]["loss"] > math.log(1024) - 0.5, "starts near the uniform loss over 1024 tokens"
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] < train[0]["loss"]


def test_lr_follows_the_schedule_once_per_optimizer_step(run):
    """The rate logged and the rate the optimizer used: each parameter group's `lr` in the checkpoints' optimizer
    state (every rank's shard) is the one the loop set for the checkpoint's last step."""
    config = run["config"]

    def scheduled(step: int) -> float:  # the rate of the optimizer step that has `step` completed steps before it
        return lr_at_step(step, learning_rate=config.learning_rate, warmup_steps=config.warmup_steps,
                          total_steps=STEPS, lr_scheduler_type=config.lr_scheduler_type,
                          min_lr=config.lr_scheduler_kwargs["min_lr"])  # fmt: skip

    logged = {record["step"]: record["lr"] for record in read_metrics(run["dir"] / "metrics.jsonl") if "lr" in record}
    assert sorted(logged) == list(range(5, STEPS + 1, 5))
    for step, lr in logged.items():
        # The logged rate is the one used by the window's last optimizer step (step - 1 steps before it).
        assert lr == pytest.approx(scheduled(step - 1), rel=1e-9), step
    # an optimizer left at its initial rate, or at an earlier step's, would differ: the rate moved
    assert len({config.learning_rate, logged[30], logged[STEPS]}) == 3
    used = {step: optimizer_rates(run["dir"] / f"checkpoint-{step}") for step in (30, STEPS)}
    assert used == {step: [pytest.approx(logged[step], rel=1e-9)] * 4 for step in used}, "2 ranks x 2 groups"


def optimizer_rates(checkpoint) -> list[float]:
    """Each parameter group's learning rate in each rank's ZeRO-3 optimizer shard of `checkpoint`."""
    rates = []
    for shard in sorted((checkpoint / "pytorch_model").glob("*optim_states.pt")):
        state = torch.load(shard, map_location="cpu", weights_only=False)  # written by the run under test
        rates += [group["lr"] for group in state["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]]
    return rates


def test_ranks_are_distinct_and_the_model_is_partitioned(run):
    log = run["log"]
    assert "attention: sdpa" in log
    match = re.search(r"model: ([\d.e+]+) parameters; this rank holds (\d+) elements", log)
    total, local = float(match.group(1)), int(match.group(2))
    assert local < 0.55 * total, "partitioned init: rank 0 holds about half of the parameters, not all"
    ds_config = json.loads((run["dir"] / "deepspeed_config.json").read_text())
    assert ds_config["train_batch_size"] == 32 and ds_config["gradient_clipping"] == 1.0
    summary = json.loads((run["dir"] / "run_summary.json").read_text())
    assert len(summary["peak_host_memory_gb_per_rank"]) == 2
    assert summary["steps"] == STEPS and summary["stop_reason"] == "max_steps"


def test_the_plan_stands_beside_what_the_run_measured(run):
    """report.md and run_summary.json: each planned quantity, the measured one (exactly what was logged), the ratio."""
    summary = json.loads((run["dir"] / "run_summary.json").read_text())
    rows = {row["quantity"]: row for row in summary["plan_vs_measured"]}
    assert list(rows) == ["step_time_s", "tokens_per_s", "peak_gpu_memory_gb", "peak_host_memory_gb_per_node"]
    logged = [r for r in read_metrics(run["dir"] / "metrics.jsonl") if "tokens_per_s" in r][1:]
    median = sorted(r["tokens_per_s"] for r in logged)[len(logged) // 2]
    assert rows["tokens_per_s"]["measured"] == median
    assert rows["step_time_s"]["measured"] == sorted(r["step_time_s"] for r in logged)[len(logged) // 2]
    assert rows["tokens_per_s"]["plan"] > 0, "tiny_cpu.yaml plans with its peak and MFU"
    assert rows["tokens_per_s"]["ratio"] == pytest.approx(median / rows["tokens_per_s"]["plan"])
    assert rows["peak_host_memory_gb_per_node"]["measured"] == pytest.approx(
        sum(summary["peak_host_memory_gb_per_rank"])
    )
    assert rows["peak_gpu_memory_gb"]["measured"] is None and rows["peak_gpu_memory_gb"]["ratio"] is None, "no CUDA"
    report = (run["dir"] / "report.md").read_text()
    assert "## Plan vs measured" in report
    assert f"| tokens/s (all ranks) | {rows['tokens_per_s']['plan']:,.2f} | {median:,.2f} |" in report


def test_checkpoints_are_complete_and_rotated(run):
    checkpoints = sorted(p.name for p in run["dir"].glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-30", "checkpoint-40"]
    assert not list(run["dir"].glob(".checkpoint-*.tmp")), "no staging directory is left behind"
    # the other dot-files there: only the reader pins of exports at work now (the tests share one run; a finished
    # export removes its pin)
    assert all(p.name.endswith(".readers") for p in run["dir"].glob(".checkpoint-*"))
    latest = run["dir"] / "checkpoint-40"
    manifest = json.loads((latest / "manifest.json").read_text())
    rows_per_rank = STEPS * 8 * 2  # steps x micro-batch x accumulation
    assert manifest["step"] == STEPS and manifest["world_size"] == 2
    assert [p["rows_consumed"] for p in data_position(latest)["per_rank"]] == [rows_per_rank] * 2
    assert verify_checksums(latest) == [] and len(manifest["files"]) >= 6
    assert (run["dir"] / "latest").read_text().strip() == "checkpoint-40"
    shards = sorted(p.name for p in (latest / "pytorch_model").iterdir())
    assert any("zero_pp_rank_1" in name for name in shards), "each rank wrote its own ZeRO-3 shard"
    assert (latest / "config.yaml").exists() and (latest / "random_states_1.pkl").exists()


def test_final_model_loads_generates_and_matches_the_logged_eval_loss(run):
    final = run["dir"] / "final"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    prompt = tokenizer("def main(", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 12

    config = run["config"]
    rows = load_validation_rows(
        [str(run["corpus"]["validation"])], tokenizer, config.max_seq_length, "text", config.max_eval_samples
    )
    with torch.no_grad():
        loss = model(input_ids=rows, labels=rows).loss.item()
    logged = [r["eval_loss"] for r in read_metrics(run["dir"] / "metrics.jsonl") if "eval_loss" in r][-1]
    assert loss == pytest.approx(logged, abs=0.05), "final/ holds the consolidated weights that were evaluated"
    assert (run["dir"] / "loss.png").read_bytes()[:4] == b"\x89PNG"
    report = (run["dir"] / "report.md").read_text()
    assert f"steps: {STEPS} (max_steps)" in report and "best eval loss" in report


def test_continues_from_the_exported_checkpoint(run, tmp_path):
    """`model_name_or_path` starts from trained weights: the first evaluation is where the first run ended."""
    args = tiny_overrides(
        run["corpus"],
        tmp_path,
        model_name_or_path=run["dir"] / "final",
        model_config="{}",
        max_steps=5,
        logging_steps=5,
        eval_steps=5,
        save_steps=5,
        max_eval_samples=32,
        warmup_steps=0,
        learning_rate="3e-4",
        lr_scheduler_kwargs="{min_lr: 3e-4}",
    )
    result = launch(REPO / "recipes/pretrain.py", args)
    assert result.returncode == 0, result.stderr[-6000:]
    first_run = [r["eval_loss"] for r in read_metrics(run["dir"] / "metrics.jsonl") if "eval_loss" in r]
    continued = [r["eval_loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if "eval_loss" in r]
    assert continued[0] == pytest.approx(first_run[-1], abs=0.1)
    assert continued[0] < math.log(1024) - 0.5, "a fresh model would start near the uniform loss"


def test_config_errors_are_reported_without_a_launch():
    command = [sys.executable, "recipes/pretrain.py", "--config", str(TINY_RECIPE), "--learnin_rate", "1e-4"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unknown key --learnin_rate on the command line" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_bf16_path_trains_and_resumes_bit_exactly(tmp_path, corpus):
    """bf16 mixed precision as a 70B run uses it, on every machine (~4 s a step where the CPU emulates bf16)."""
    args = tiny_overrides(
        corpus, tmp_path / "full", bf16="true", max_steps=2, save_steps=1, logging_steps=1, eval_steps=100,
        warmup_steps=1, **{"model_config.num_hidden_layers": 2},
    )  # fmt: skip
    full = launch(REPO / "recipes/pretrain.py", args)
    assert full.returncode == 0, full.stderr[-4000:]
    assert json.loads((tmp_path / "full" / "deepspeed_config.json").read_text())["bf16"]["enabled"] is True
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", resumed_dir, ignore=shutil.ignore_patterns("checkpoint-2", "final"))
    (resumed_dir / "latest").write_text("checkpoint-1\n")
    resumed = launch(REPO / "recipes/pretrain.py", [*args, "--output_dir", str(resumed_dir)])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "checkpoint-1 at step 1" in resumed.stderr
    emulated = "emulates it, 10-100x slower" in full.stderr
    assert emulated == (not cpu_has_native_bf16()), "the run says when this CPU emulates bf16"

    def losses(run_dir):
        return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}

    assert losses(resumed_dir) == losses(tmp_path / "full") and sorted(losses(resumed_dir)) == [1, 2]


class ForceEosAt:
    """A logits processor that makes the n-th generated token EOS: generation must stop right after it."""

    def __init__(self, prompt_length: int, n: int, eos_id: int):
        self.at, self.eos_id = prompt_length + n - 1, eos_id

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.at:
            scores[:] = -float("inf")
            scores[:, self.eos_id] = 0.0
        return scores


def test_a_mid_run_checkpoint_exports_to_a_model_that_matches_the_live_one_and_stops_at_eos(run, tmp_path):
    from transformers import LogitsProcessorList

    checkpoint = run["dir"] / "checkpoint-30"
    dtype = "bfloat16" if run["config"].bf16 else "float32"
    command = [sys.executable, "-m", "recipes.export", str(checkpoint), "--output", str(tmp_path / "model"),
               "--dtype", dtype, "--max-shard-size", "500KB"]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout.strip().splitlines()[-1])  # the export's peak memory
    model_dir = tmp_path / "model"
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "sharded at --max-shard-size"
    assert json.loads((model_dir / "export.json").read_text())["step"] == 30

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        assert getattr(model.config, key) == getattr(model.generation_config, key) == getattr(tokenizer, key), key
    assert model.generation_config.use_cache is True
    prompt = tokenizer("def main(", return_tensors="pt")
    length = prompt["input_ids"].shape[1]
    forced = LogitsProcessorList([ForceEosAt(length, 3, tokenizer.eos_token_id)])
    generated = model.generate(**prompt, max_new_tokens=20, do_sample=False, logits_processor=forced)
    assert generated.shape[1] == length + 3 and generated[0, -1] == tokenizer.eos_token_id, "stops at the EOS"

    # the live model's own measurement at step 30 is not logged, step 40's is: export 40 too and compare losses
    final = run["dir"] / "final"
    assert json.loads((final / "export.json").read_text())["step"] == STEPS, "final/ comes from the same export"
    config = run["config"]
    rows = load_validation_rows(
        [str(run["corpus"]["validation"])], tokenizer, config.max_seq_length, "text", config.max_eval_samples
    )
    live = [r["eval_loss"] for r in read_metrics(run["dir"] / "metrics.jsonl") if "eval_loss" in r][-1]
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(final, dtype=getattr(torch, dtype))(input_ids=rows, labels=rows)
    assert exported.loss.item() == pytest.approx(live, rel=2e-3 if config.bf16 else 1e-5)

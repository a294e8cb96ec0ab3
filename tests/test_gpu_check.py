"""The GPU check (benchmarks/gpu_check.py): its CPU dry run exercises every stage, so that the script is ready
when a GPU is; its judgement of targets is checked here on numbers that meet and miss them."""

import json
import subprocess
import sys

import pytest

from benchmarks import gpu_check_report
from tests.conftest import LAUNCH_ENV, REPO


def training_run(**changes) -> dict:
    run = {"micro_batch": 2, "gradient_checkpointing": False, "leaves": True, "attn_implementation": "sdpa",
           "bare_s_per_step": 1.0, "recipe_s_per_step": 1.02, "recipe_masked_s_per_step": 1.1, "recipe_mfu": 0.42,
           "bare_mfu": 0.43, "recipe_masked_mfu": 0.39, "plan_mfu": 0.45, "steady_allocated_gb": 18.0,
           "peak_allocated_gb": 28.0, "peak_reserved_gb": 33.0}  # fmt: skip
    run.update(changes)
    plan = {"bf16_parameter_shard": 2.2, "optimizer_states": 13.2, "fp32_gradient_partition": 4.4,
            "bf16_gradient_shard": 2.2, "largest_layer_gathered": 0.3, "reduce_bucket": 0.4, "prefetch_bucket": 0.4,
            "live_parameters": 2.0, "activations": 6.0, "logits": 1.6, "cuda_context": 1.5, "total": 36.0}  # fmt: skip
    run["plan_memory"] = gpu_check_report.memory_against_plan(run, plan)
    return run


def test_targets_are_met_and_missed_by_the_numbers():
    good = {"dry_run": False, "stages": {"training": [training_run()]}, "skipped": [], "targets": []}
    targets = gpu_check_report.judge(good)
    assert [t["met"] for t in targets] == [True, True, True]
    assert targets[2]["value"] == pytest.approx(33.0 / 34.5)
    slow = training_run(recipe_mfu=0.12, recipe_s_per_step=1.2, peak_reserved_gb=50.0, peak_allocated_gb=45.0)
    missed = gpu_check_report.judge({**good, "stages": {"training": [slow]}})
    assert [t["met"] for t in missed] == [False, False, False]
    assert missed[2]["term_off"].startswith("one step's additions")
    assert targets[0]["target"] == "MFU >= 40% (mb2, checkpointing off, leaf layers)"
    # a micro-batch that ran out of memory is reported, and judged by no target
    oom = {"micro_batch": 4, "gradient_checkpointing": False, "leaves": True, "out_of_memory": True}
    good["stages"]["training"].append(oom)
    assert gpu_check_report.judge(good) == targets
    good["targets"] = targets
    markdown = gpu_check_report.render_markdown(good)
    assert "| 2 | off | leaf layers | sdpa |" in markdown and "## Targets" in markdown
    assert "| 4 | off | leaf layers | out of memory |" in markdown
    assert gpu_check_report.docs_row(good).count("|") == 12


@pytest.mark.multiprocess
def test_the_dry_run_exercises_every_stage_on_the_cpu(tmp_path):
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--output", str(tmp_path)]
    completed = subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["dry_run"] and results["skipped"] == [] and results["targets"] == []
    stages = results["stages"]
    assert stages["model_only"]["tokens_per_s"] > 0
    runs = stages["training"]
    assert [(r["micro_batch"], r["gradient_checkpointing"], r["leaves"]) for r in runs] == [
        (2, True, True),
        (1, False, False),
    ]
    assert [r["zero3_leaf_modules"] for r in runs] == [["LlamaDecoderLayer"], []]
    assert [r["plan_hooked_modules"] for r in runs] == [7, 39], "4 layers: 2 + 4 + 1 units, or 2 + 4 x 9 + 1"
    # benchmarks/step_overhead.py's own report, as the training stage got it from the real Trainer
    timed = runs[0]
    assert timed["ratio"] == pytest.approx(timed["recipe_s_per_step"] / timed["bare_s_per_step"])
    assert timed["document_masking"] is False and timed["recipe_cpu_s_per_step"] > 0
    assert len(timed["warmup_losses"]) == timed["gradient_accumulation_steps"] > 1  # the dry run warms up 1 step
    assert all(r["bare_s_per_step"] > 0 and r["plan_memory"]["plan_total_gb"] > 0 for r in runs)
    assert (tmp_path / "profile_mb2_leaves.txt").read_text().count("aten::") > 5
    deepcompile = stages["deepcompile"]  # CUDA only: its configs written and read back, nothing launched
    assert deepcompile["cuda_only"] and not deepcompile["ran"] and deepcompile["deepcompile"] is True
    assert "INDUCTOR" in deepcompile["dynamo_backend"].upper()
    checks = {c["attn_implementation"]: c for c in stages["attention"]["checks"]}
    assert checks["sdpa"]["path"] == "block_mask" and checks["flash_attention_2"]["path"] == "varlen"
    assert checks["flex_attention"]["path"] == "block_mask" and "torch_varlen" not in checks
    assert all(c["ok"] for c in checks.values())
    timings = {t["attn_implementation"]: t for t in stages["attention"]["timings"]}
    assert timings["sdpa"]["ran"] and timings["sdpa"]["s_per_step"] > 0
    for implementation in ("flex_attention", "torch_varlen", "flash_attention_2"):  # they train on CUDA only
        assert not timings[implementation]["ran"] and timings[implementation]["cuda_only"]
        assert "CUDA" in timings[implementation]["reason"]
    end_to_end = stages["end_to_end"]
    assert end_to_end["exit_code"] == 0 and "document masking: on" in end_to_end["attention_line"]
    assert end_to_end["mmlu_seconds_per_document"] > 0 and end_to_end["gsm8k_seconds_per_document"] > 0
    assert end_to_end["plan_gsm8k_seconds_per_document"] > 0
    assert "(CPU dry run: no GPU result)" in (tmp_path / "gpu_check.md").read_text()
    assert "row for docs/gpu-results.md:" in completed.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_real_check_refuses_in_one_line():
    completed = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=REPO, env=LAUNCH_ENV,
                               capture_output=True, text=True, timeout=120)  # fmt: skip
    assert completed.returncode == 2
    assert completed.stderr.strip() == (
        "error: no CUDA device is visible; `make gpu-check DRY_RUN=1` rehearses the check on the CPU"
    )


def test_a_micro_batch_series_stops_at_its_first_out_of_memory(tmp_path, monkeypatch):
    """The sweep on a GPU: micro-batch 4 runs out of memory with leaf layers, so 8 is not tried at that granularity;
    the per-module series goes on. The launch's whole stderr is searched (its tail may be the launcher's traceback)."""
    import time

    from benchmarks import gpu_check, step_overhead
    from benchmarks.gpu_check_setup import GPU_SWEEP, Report, Scale

    tried = []

    def fake_run(args):
        micro = int(args[args.index("--per_device_train_batch_size") + 1])
        leaves = args[args.index("--zero3_leaf_modules") + 1] != "[]"
        tried.append((micro, leaves))
        if leaves and micro >= 4:
            raise step_overhead.LaunchOutOfMemory("...torch.OutOfMemoryError: CUDA out of memory...")
        return {"micro_batch": micro, "gradient_checkpointing": True, "attn_implementation": "sdpa",
                "steady_allocated_gb": None, "peak_allocated_gb": None, "peak_reserved_gb": None}  # fmt: skip

    monkeypatch.setattr(step_overhead, "run", fake_run)
    scale = Scale.of(dry_run=False)
    assert scale.configurations == GPU_SWEEP
    report = Report(tmp_path, dry_run=False)
    gpu_check.training_stage(report, tmp_path, scale, deadline=time.monotonic() + 600)
    assert tried == [(1, True), (2, True), (4, True), (1, False), (2, False), (4, False), (8, False)]
    runs = report.results["stages"]["training"]
    assert [(r["micro_batch"], r["leaves"], r.get("out_of_memory", False)) for r in runs] == [
        (1, True, False), (2, True, False), (4, True, True), (1, False, False), (2, False, False), (4, False, False),
        (8, False, False)]  # fmt: skip
    assert [r["plan_hooked_modules"] for r in runs if not r.get("out_of_memory")] == [25, 25, 201, 201, 201, 201]

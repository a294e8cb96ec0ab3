"""The GPU check (benchmarks/gpu_check.py): its CPU dry run exercises every stage, so that the script is ready
when a GPU is; its judgement of targets is checked here on numbers that meet and miss them."""

import json
import os
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
    assert targets[0]["target"] == "recipe MFU >= 30% (mb2, checkpointing off, leaf layers)"
    assert targets[1]["target"] == "recipe >= 0.95x bare (mb2, checkpointing off, leaf layers)"
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
    out = tmp_path / "out"  # what a lent machine sends back: a few flat files
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--output", str(tmp_path), "--results-dir",
               str(out)]  # fmt: skip
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
    deepcompile = stages["deepcompile"]  # launched with the backend in its environment; `ran` only where active
    assert deepcompile["cuda_only"] and deepcompile["deepcompile"] is True
    assert "INDUCTOR" in deepcompile["dynamo_backend"].upper() and deepcompile["worker_dynamo_backend"] == "inductor"
    assert deepcompile["warmup_steps"] > 5, "past DeepSpeed's WARMUP step, where DeepCompile's passes recompile"
    assert deepcompile["ran"] == deepcompile.get("deepcompile_active", False)
    if not deepcompile["ran"]:  # on the CPU: the rank's own error (DeepCompile's op needs CUDA), not torchrun's box
        assert deepcompile["reason"].startswith(("launch failed", "DeepCompile not active"))
        assert "ChildFailedError" not in deepcompile["reason"], deepcompile["reason"]
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
    assert sorted(path.name for path in out.iterdir()) == [
        "end_to_end_tail.log", "gpu_check.json", "gpu_check.md", "profile_mb2_leaves.txt"]  # fmt: skip
    assert json.loads((out / "gpu_check.json").read_text()) == results


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_the_real_check_refuses_in_one_line():
    completed = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=REPO, env=LAUNCH_ENV,
                               capture_output=True, text=True, timeout=120)  # fmt: skip
    assert completed.returncode == 2
    assert completed.stderr.strip() == (
        "error: no CUDA device is visible; `make gpu-check DRY_RUN=1` rehearses the check on the CPU"
    )


def test_a_micro_batch_series_stops_at_its_first_out_of_memory(tmp_path, monkeypatch):
    """The sweep on a GPU, the most telling configurations first: micro-batch 8 runs out of memory with leaf layers
    and 4 is tried; it runs out too, so the tail does not try 8 at that granularity again; the per-module series goes
    on. The launch's whole stderr is searched (its tail may be the launcher's traceback)."""
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
    assert scale.configurations + scale.tail_configurations == GPU_SWEEP and scale.timed_steps == 5
    report = Report(tmp_path, dry_run=False)
    gpu_check.training_stage(report, tmp_path, scale, deadline=time.monotonic() + 600)
    assert tried == [(2, True), (2, False), (8, True), (4, True)]
    gpu_check.training_tail_stage(report, tmp_path, scale, deadline=time.monotonic() + 600)
    assert tried[4:] == [(1, True), (4, False), (8, False), (1, False)]
    runs = report.results["stages"]["training"]
    assert [(r["micro_batch"], r["leaves"], r.get("out_of_memory", False)) for r in runs] == [
        (2, True, False), (2, False, False), (8, True, True), (4, True, True), (1, True, False), (4, False, False),
        (8, False, False), (1, False, False)]  # fmt: skip
    assert [r["plan_hooked_modules"] for r in runs if not r.get("out_of_memory")] == [25, 201, 25, 201, 201, 201]


def test_the_deepcompile_stage_warms_up_past_deepspeeds_recompile_step():
    """DeepCompile applies its prefetch and selective-gather passes at DeepSpeed's WARMUP step: with fewer warm-up
    steps the recompile would land in the timed loop. The launch's backend is what the worker's Accelerator reads."""
    from deepspeed.compile.init_z3 import WARMUP

    from benchmarks import gpu_check_kernels, step_overhead

    assert gpu_check_kernels.DEEPCOMPILE_PASSES_STEP == WARMUP
    environment = {**gpu_check_kernels.DEEPCOMPILE_ENV}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in environment.items():
            patch.setenv(key, value)
        assert step_overhead.worker_context() == {"dynamo_backend": "inductor"}


def test_the_deepcompile_stage_is_not_ran_where_deepcompile_is_not_active(tmp_path, monkeypatch):
    """A launch that trains but whose engine did not take DeepCompile (an eager DeepSpeed) is not reported as run;
    a failed one keeps what its worker saw and its traceback."""
    import time

    from benchmarks import gpu_check_kernels, step_overhead
    from benchmarks.gpu_check_setup import Report, Scale

    launches = []

    def eager(args, env=None):
        launches.append((args, env))
        return {"dynamo_backend": "inductor", "compiled": True, "deepcompile_active": False, "bare_s_per_step": 1.0}

    monkeypatch.setattr(step_overhead, "run", eager)
    report = Report(tmp_path, dry_run=False)
    gpu_check_kernels.deepcompile_stage(report, tmp_path, Scale.of(dry_run=False), deadline=time.monotonic() + 600)
    result = report.results["stages"]["deepcompile"]
    assert not result["ran"] and "not active" in result["reason"] and result["worker_dynamo_backend"] == "inductor"
    args, env = launches[0]
    assert env["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR"
    assert float(args[args.index("--timeout-s") + 1]) == 180.0 and int(args[args.index("--warmup-steps") + 1]) >= 7

    def failed(args, env=None):
        message = "Traceback ...\nRuntimeError: Error building extension"
        raise step_overhead.LaunchFailed(message, {"dynamo_backend": "no"})

    monkeypatch.setattr(step_overhead, "run", failed)
    gpu_check_kernels.deepcompile_stage(report, tmp_path, Scale.of(dry_run=False), deadline=time.monotonic() + 100)
    result = report.results["stages"]["deepcompile"]
    assert not result["ran"] and result["worker_dynamo_backend"] == "no" and "building extension" in result["reason"]


def test_stages_run_in_the_order_given_and_a_launch_needs_the_last_ones_time(tmp_path):
    import time

    from benchmarks import gpu_check
    from benchmarks.gpu_check_setup import MIN_LAUNCH_S, Report

    args = gpu_check.arguments(["--stages", "attention,model_only,training_tail"])
    assert args.stages == ["attention", "model_only", "training_tail"]
    assert gpu_check.arguments([]).stages[:2] == ["model_only", "training"]
    report = Report(tmp_path / "work", dry_run=False, results_dir=tmp_path / "out")
    assert report.time_for_launch(time.monotonic() + MIN_LAUNCH_S - 1) is None  # before the first launch
    assert report.time_for_launch(time.monotonic() + 100) > 90
    report.last_launch_s = 120.0  # the previous launch's wall time: 100 s left cannot hold another
    assert report.time_for_launch(time.monotonic() + 100) is None
    assert report.time_for_launch(time.monotonic() + 130) > 120
    report.stage("model_only", {"tokens_per_s": 1.0})  # every write is mirrored, flat
    assert json.loads((tmp_path / "out/gpu_check.json").read_text())["stages"]["model_only"]["tokens_per_s"] == 1.0
    log = tmp_path / "work/end_to_end.log"
    log.write_text("".join(f"line {i}\n" for i in range(500)))
    report.mirror(log, "end_to_end_tail.log", tail_lines=3)
    assert (tmp_path / "out/end_to_end_tail.log").read_text() == "line 497\nline 498\nline 499\n"


def test_the_attention_stage_keeps_each_path_and_survives_a_check_that_runs_out_of_time(tmp_path, monkeypatch):
    """Each path is written as it finishes; a check killed by the budget costs that check alone; the check builds
    two layers."""
    import time

    from benchmarks import gpu_check_kernels, step_overhead
    from benchmarks.gpu_check_setup import Report, Scale
    from recipes.training import model

    commands = []

    def fake_check(command, **kwargs):
        commands.append(command)
        implementation = command[command.index("--attn_implementation") + 1]
        if implementation == "flex_attention":
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        check = {"attn_implementation": implementation, "kernel": "k", "micro_batch": 2, "path": "varlen",
                 "expected_path": "varlen", "max_abs_diff": 0.0, "tolerance": 0.05, "ok": True}  # fmt: skip
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(check) + "\n", stderr="")

    def fake_run(args):
        written = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]["attention"]
        assert [c["attn_implementation"] for c in written["checks"]] == ["sdpa"]  # on disk before the timing
        return {"attn_implementation": "sdpa", **{f"recipe_masked_{k}": 1.0 for k in ("s_per_step", "tokens_per_s",
                                                                                      "mfu")}}  # fmt: skip

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # flash_attention_2's reference check runs
    monkeypatch.setattr(gpu_check_kernels.subprocess, "run", fake_check)
    monkeypatch.setattr(step_overhead, "run", fake_run)
    monkeypatch.setattr(model, "detect_attn_implementation",
                        lambda name: (name, None) if name == "sdpa" else ("sdpa", f"{name}: needs CUDA"))  # fmt: skip
    report = Report(tmp_path, dry_run=False)
    gpu_check_kernels.attention_stage(report, tmp_path, Scale.of(False), deadline=time.monotonic() + 600)
    assert all(command[command.index("--num-layers") + 1] == "2" for command in commands)
    attention = report.results["stages"]["attention"]
    assert [c["attn_implementation"] for c in attention["checks"]] == ["sdpa", "flash_attention_2"]
    assert [t["ran"] for t in attention["timings"]] == [True, False, False, False]
    assert [s["stage"] for s in report.results["skipped"]] == ["attention_check flex_attention"]


def test_make_gpu_check_asks_for_a_cuda_python_instead_of_installing_a_cpu_one():
    """`make install` builds a CPU-only .venv, and a lent GPU machine has no network for pip: without
    GPU_CHECK_PYTHON the target said nothing and spent minutes installing the wrong packages."""
    import subprocess

    env = {key: value for key, value in os.environ.items() if key not in ("GPU_CHECK_PYTHON", "DRY_RUN")}
    result = subprocess.run(["make", "-s", "gpu-check"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "error: on a GPU, run make gpu-check GPU_CHECK_PYTHON=python3" in result.stderr
    assert "pip install" not in result.stdout + result.stderr

"""Every benchmark under benchmarks/ runs briefly here, so that none can silently break (the step-overhead one
drives the real Trainer, which it once stopped doing without a test noticing)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import LAUNCH_ENV, REPO


def run_benchmark(module: str, *args: str) -> dict:
    """Run `python -m benchmarks.<module>`; the JSON line it ends with."""
    command = [sys.executable, "-m", f"benchmarks.{module}", *args]
    result = subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def small_corpus(tmp_path, corpus, lines: int) -> str:
    small = tmp_path / "small.jsonl"
    small.write_text("".join(corpus["train"].read_text().splitlines(keepends=True)[:lines]))
    return str(small)


def test_step_overhead_names_its_loops_before_launching_anything():
    """The benchmark itself runs on the real Trainer in tests/test_gpu_check.py's dry run (the training stage calls
    `step_overhead.run` with the loops bare, recipe and recipe_masked); here only its refusal, which costs no launch."""
    command = [sys.executable, "-m", "benchmarks.step_overhead", "--loops", "bare,fast"]
    result = subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "fast" in result.stderr and "Traceback" not in result.stderr, result.stderr


def compare_with_head() -> list[str]:
    """`--compare-commit HEAD` where this is a git checkout with that file (a tarball of the code has no history)."""
    shown = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", "HEAD:data_prep/packing/stream.py"],
                           capture_output=True)  # fmt: skip
    return ["--compare-commit", "HEAD"] if shown.returncode == 0 else []


def test_data_throughput_runs_every_method_on_a_small_corpus(tmp_path, corpus):
    report = run_benchmark("data_throughput", "--input", small_corpus(tmp_path, corpus, 40), "--tokenizer",
                           str(corpus["tokenizer"]), "--seq-len", "64", "--workers", "2", "--repeats", "2",
                           *compare_with_head())  # fmt: skip
    assert report["one_thread_repeats"] == 2 and report["pipeline_vs_raw_1_thread"] > 0
    assert 0 < report["pipeline_vs_raw_1_thread_paired"] < 2
    assert not compare_with_head() or 0 < report["baseline_vs_raw_1_thread_paired"] < 2
    for key in (
        "raw_tokenizer_tokens_per_s",
        "raw_tokenizer_1_thread_tokens_per_s",
        "pipeline_tokens_per_s",
        "pipeline_workers_tokens_per_s",
        "preprocess_tokens_per_s",
        "run_clm_tokens_per_s",
        "preprocess_filtered_tokens_per_s",
    ):
        assert report[key] > 0, key
    assert report["filtered_dropped"]["contaminated"] == 0, "the synthetic benchmark items match nothing"


def test_mixture_sampling_runs_on_a_small_corpus(tmp_path, corpus):
    report = run_benchmark("mixture_sampling", "--input", small_corpus(tmp_path, corpus, 60), "--tokenizer",
                           str(corpus["tokenizer"]), "--seq-len", "64", "--rows", "500")  # fmt: skip
    assert report["rows"] == 500 and report["single_us_per_row"] > 0 and report["mixture_us_per_row"] > 0
    # every row timed was read whole, on both sides, and the mixture's rows came from its sources by its weights
    assert report["read"] == {side: {"rows": 500, "tokens": 500 * 64} for side in ("single", "mixture")}
    assert report["mixture_weights"] == [0.7, 0.3]
    assert report["mixture_drawn"] == pytest.approx([0.7, 0.3], abs=0.02)


@pytest.mark.multiprocess
def test_eval_in_loop_times_both_modes_on_two_ranks():
    from eval import fixtures

    report = run_benchmark("eval_in_loop", "--limit", "2", "--max-gen-toks", "4", "--repeats", "1")
    assert report["replicated_s"] > 0 and report["sharded_s"] > 0
    assert report["speedup"] == pytest.approx(report["replicated_s"] / report["sharded_s"])
    # both modes scored every document (2 of each task; the sharded mode's gathered from both ranks), alike
    tasks = {f"mmlu_local_{subject}" for subject in fixtures.SUBJECTS} | {"gsm8k_local"}
    replicated, sharded = report["scored"]["replicated"], report["scored"]["sharded"]
    assert replicated is not None and sharded is not None, f"a mode returned no results: {report['scored']}"
    assert replicated["documents"] == sharded["documents"] == dict.fromkeys(tasks, 2), report["scored"]
    assert replicated["scores"].keys() == sharded["scores"].keys() == tasks
    for task, scores in replicated["scores"].items():
        assert {"acc,none", "exact_match,strict-match"} & scores.keys(), (task, scores)
        assert sharded["scores"][task] == pytest.approx(scores), task


@pytest.mark.multiprocess
def test_clean_quality_plants_copies_and_measures_them(tmp_path):
    from tests.test_clean import write_cleaning_corpus

    corpus = write_cleaning_corpus(tmp_path / "raw", documents=30, copies=0)
    report = run_benchmark("clean_quality", "--input", *corpus["files"], "--copies", "8", "--workers", "2")
    # 8 copies with 2 % of the words changed, similarity ~0.74 on these 260-word documents: each found with
    # probability ~0.96 (the figure that matters is the benchmark's, on real text)
    assert report["planted_pairs"] == 8 and report["recall"] >= 0.75
    assert report["false_positives"] == 0 and report["other_documents"] == 30 + 2 - 8  # + noise, - originals
    assert report["filters_kept_docs"] == 30 and report["filters_and_dedup_kept_docs"] == 30
    assert report["filters_mb_per_s_per_core"] > 0 and report["filters_and_dedup_peak_rss_mb"] > 0


@pytest.mark.multiprocess
def test_clean_quality_measures_what_each_preset_keeps(tmp_path):
    from tests.test_clean import write_cleaning_corpus

    corpus = write_cleaning_corpus(tmp_path / "raw", documents=30, copies=0)
    measured = run_benchmark("clean_quality", "--input", *corpus["files"], "--presets", "--workers", "2")["presets"]
    assert set(measured) == {"web", "curated"}
    for preset in measured.values():  # both keep the 30 documents and remove the repetition and the garbled text
        assert preset["docs"] == 32 and preset["kept_docs"] == pytest.approx(30 / 32) and preset["warnings"] == []
        assert preset["steps"]["unknown_characters"]["top_reason"] == "unknown_characters"
        assert preset["steps"]["gopher_repetition"]["docs_kept"] == pytest.approx(30 / 31)
    assert "c4_quality" in measured["web"]["steps"] and "c4_quality" not in measured["curated"]["steps"]


@pytest.mark.multiprocess
def test_clean_quality_compares_stock_and_shared_split_speed_and_decisions(tmp_path):
    from tests.test_clean import write_cleaning_corpus

    corpus = write_cleaning_corpus(tmp_path / "raw", documents=12, copies=2)
    report = run_benchmark("clean_quality", "--input", *corpus["files"], "--compare-speed", "--rounds", "1")
    assert [run["pipeline"] for run in report["runs"]] == ["stock", "shared_split"]
    assert min(min(run["mb_per_s_per_core"], run["mb_per_cpu_s"]) for run in report["runs"]) > 0
    assert report["speedup"] > 0 and report["cpu_speedup"] > 0
    assert report["documents"] == 12 + 2 + 2 and report["decisions_same"] == 16 and report["agreement"] == 1.0
    assert report["decisions_differ"] == [] and report["removals_by_step_and_reason_equal"] is True


@pytest.mark.multiprocess
def test_zero3_host_tax_times_plain_torch_and_both_granularities():
    report = run_benchmark("zero3_host_tax", "--layers", "4", "--steps", "1", "--rounds", "1")
    assert report["persistence_threshold"] == 640, "10 x the default hidden size: projections partitioned"
    cpu = report["cpu_s_per_step"]
    assert set(cpu) == {"plain", "zero3_per_module", "zero3_leaves"} and min(cpu.values()) > 0
    assert report["overhead_left_with_leaves"] == pytest.approx(
        (cpu["zero3_leaves"] - cpu["plain"]) / (cpu["zero3_per_module"] - cpu["plain"]))  # fmt: skip
    recipe = report["recipe_s_per_step"]
    assert report["recipe_speedup"] == pytest.approx(recipe["per_module"] / recipe["leaves"])
    assert report["warmup_losses_equal"] is True, "the same engine's first losses, with and without leaves"


def test_the_host_tax_launches_with_its_threshold_and_the_shipped_json_otherwise(tmp_path):
    """The scaled threshold reaches the DeepSpeed JSON the launch reads; every other value is the shipped one's."""
    import yaml

    from benchmarks.zero3_host_tax import TWO_RANKS, with_threshold

    def deepspeed_json(accelerate_config):
        path = yaml.safe_load(accelerate_config.read_text())["deepspeed_config"]["deepspeed_config_file"]
        return json.loads((REPO / path).read_text())  # an absolute path stays itself under REPO /

    launched, shipped = deepspeed_json(with_threshold(TWO_RANKS, 640, tmp_path)), deepspeed_json(TWO_RANKS)
    assert launched["zero_optimization"].pop("stage3_param_persistence_threshold") == 640
    shipped["zero_optimization"].pop("stage3_param_persistence_threshold")
    assert launched == shipped


def test_elastic_drift_builds_valid_launches_and_compares_losses(tmp_path, corpus):
    """The benchmark's launches take ~5 minutes (docs/slurm.md gives its figures); here its recipe arguments load
    as a recipe, its comparison is checked on known losses, and a change step outside the run is refused."""
    from benchmarks.elastic_drift import GLOBAL_BATCH_ROWS, RECIPE, relative_differences, run_args
    from recipes.config import load_config

    data = {"tokenizer": corpus["tokenizer"], "packed": tmp_path, "validation": corpus["validation"]}
    config = load_config(RECIPE, run_args(data, tmp_path / "out", steps=16, dtype="fp32", save_steps=6)[2:])
    assert config.elastic and config.global_batch_size == GLOBAL_BATCH_ROWS and not config.bf16
    assert config.save_steps == 6 and config.max_steps == 16
    reference = {1: 4.0, 2: 3.0, 3: 2.0, 4: 1.0}
    measured = relative_differences({1: 4.0, 2: 3.0, 3: 2.02, 4: 0.9}, reference, after=2)
    assert measured == pytest.approx({"first_step_after": 0.01, "largest_after": 0.1})
    refused = subprocess.run([sys.executable, "-m", "benchmarks.elastic_drift", "--steps", "4", "--change-at", "4"],
                             cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 2 and "--change-at 4: must be between 1 and --steps - 1 (3)" in refused.stderr


def test_elastic_drift_tells_a_launch_stopped_at_its_checkpoint_from_one_that_failed(tmp_path):
    """The benchmark's 2-process part of `elastic` is killed once its checkpoint exists; one that crashed before it
    used to pass as stopped, and the 1-process resume then trained from scratch (no checkpoint: a fresh start), making
    `elastic` a 1-process run. Commands stand in for the launches (a real measure() is 4 launches, minutes)."""
    import contextlib

    import psutil

    from benchmarks.elastic_drift import launch

    stop = tmp_path / "checkpoint-6" / "manifest.json"
    crash = [sys.executable, "-c", "import sys; print('crashed before its checkpoint'); sys.exit(3)"]
    for stop_after in (stop, None):
        with pytest.raises(RuntimeError, match=r"launch failed \(exit 3\)"):
            launch(crash, tmp_path / "crashed.log", stop_after=stop_after)
    with pytest.raises(RuntimeError, match=r"ended \(exit 0\) before .*manifest\.json, where it was to be stopped"):
        launch([sys.executable, "-c", "pass"], tmp_path / "ended.log", stop_after=stop)
    # one that writes its checkpoint and trains on, with a child as a launcher has ranks: stopped, the child with it
    trains_on = (
        "import pathlib, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(child.pid, flush=True)\n"
        "path = pathlib.Path(sys.argv[1]); path.parent.mkdir(); path.write_text('{}'); time.sleep(120)\n"
    )
    launch([sys.executable, "-c", trains_on, str(stop)], tmp_path / "stopped.log", stop_after=stop)
    child = int((tmp_path / "stopped.log").read_text().split()[0])
    with contextlib.suppress(psutil.NoSuchProcess):
        assert psutil.Process(child).status() == psutil.STATUS_ZOMBIE, "the launcher's child outlived the stop"


def test_data_cost_counts_each_stages_cpu_time_on_a_small_corpus(tmp_path, corpus):
    """Tokenizer training and preprocessing on the small corpus (cleaning's commands are walked by its own tests):
    every stage's CPU time is counted (the workers' too) and priced per TB and per cluster."""
    from benchmarks.data_cost import cluster_hours, per_tb

    out = tmp_path / "cost.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.data_cost", "--input", str(corpus["validation"]),
                             "--work", str(tmp_path / "work"), "--stages", "tokenizer,preprocess", "--vocab-size",
                             "512", "--workers", "2", "--json-output", str(out)], cwd=REPO, env=LAUNCH_ENV,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["stages"]) == {"tokenizer", "preprocess"}
    for stage in report["stages"].values():
        expected = per_tb(stage["cpu_s"], report["input_mb"])
        assert stage["cpu_s"] > 0 and stage["core_hours_per_tb"] == pytest.approx(expected)
    assert per_tb(3600, 1e6) == 1 and cluster_hours(1280, 14, 8, 64) == pytest.approx(35)


def test_step_overhead_reports_the_ranks_traceback_not_the_launchers(tmp_path):
    """A failed launch raises with what each rank's worker wrote beside the output (torchrun's summary box says
    nothing of the cause), and with what the worker saw at its start."""
    from benchmarks import step_overhead

    output = tmp_path / "timings.json"
    (tmp_path / "timings.json.rank0.traceback").write_text("Traceback (most recent call last):\nValueError: the cause")
    (tmp_path / "timings.json.context.json").write_text(json.dumps({"dynamo_backend": "inductor"}))
    failure = step_overhead.launch_failure("launch exited 1", "ChildFailedError\n" + "=" * 5000, output)
    assert type(failure) is step_overhead.LaunchFailed and failure.context == {"dynamo_backend": "inductor"}
    assert "ValueError: the cause" in str(failure) and "ChildFailedError" not in str(failure)
    (tmp_path / "timings.json.rank0.traceback").unlink()
    oom = step_overhead.launch_failure("launch exited 1", "torch.OutOfMemoryError: CUDA out of memory" + "x" * 5000,
                                       output)  # fmt: skip
    assert isinstance(oom, step_overhead.LaunchOutOfMemory)


@pytest.mark.multiprocess
def test_a_timed_out_step_overhead_launch_leaves_no_rank_alive():
    """Past `--timeout-s` the whole launch is killed: torchrun starts each rank in a session of its own, so killing
    accelerate alone would leave them running on the device. The stderr captured so far comes with the error."""
    import threading
    import time

    import psutil

    from benchmarks import step_overhead

    marker = "987651"  # a step count no other launch uses: the ranks' command lines carry it

    def ranks() -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter(["cmdline"]):
            cmdline = process.info["cmdline"] or []
            if "--worker" in cmdline and marker in cmdline and "accelerate.commands.launch" not in cmdline:
                found.append(process)
        return found

    seen, done = set(), threading.Event()

    def watch():
        while not done.is_set():
            seen.update(process.pid for process in ranks())
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    try:
        with pytest.raises(step_overhead.LaunchFailed, match="timed out") as failure:
            step_overhead.run(["--steps", marker, "--repeats", "1", "--timeout-s", "20"], env=LAUNCH_ENV)
    finally:
        done.set()
        watcher.join()
    assert time.monotonic() - started < 60
    assert len(seen) >= 2, "the ranks had started before the timeout"
    time.sleep(1)
    assert ranks() == [], "a rank outlived its timed-out launch"
    assert str(failure.value).count("\n") > 1, "the stderr captured before the kill"

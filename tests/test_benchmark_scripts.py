"""Every benchmark under benchmarks/ runs briefly here, so that none can silently break (the step-overhead one
drives the real Trainer, which it once stopped doing without a test noticing)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import LAUNCH_ENV, REPO


@pytest.mark.multiprocess
def test_step_overhead_runs_the_real_trainer_and_reports_a_ratio():
    command = [sys.executable, "-m", "benchmarks.step_overhead", "--steps", "3", "--repeats", "1"]
    result = subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bare_s_per_step"] > 0 and report["recipe_s_per_step"] > 0
    assert report["ratio"] == pytest.approx(report["recipe_s_per_step"] / report["bare_s_per_step"])


def test_data_throughput_runs_every_method_on_a_small_corpus(tmp_path, corpus):
    small = tmp_path / "small.jsonl"
    small.write_text("".join(corpus["train"].read_text().splitlines(keepends=True)[:40]))
    command = [sys.executable, "-m", "benchmarks.data_throughput", "--input", str(small), "--tokenizer",
               str(corpus["tokenizer"]), "--seq-len", "64", "--workers", "2"]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for key in (
        "raw_tokenizer_tokens_per_s",
        "pipeline_tokens_per_s",
        "preprocess_tokens_per_s",
        "run_clm_tokens_per_s",
        "preprocess_filtered_tokens_per_s",
    ):
        assert report[key] > 0, key
    assert report["filtered_dropped"]["contaminated"] == 0, "the synthetic benchmark items match nothing"


def test_mixture_sampling_runs_on_a_small_corpus(tmp_path, corpus):
    small = tmp_path / "small.jsonl"
    small.write_text("".join(corpus["train"].read_text().splitlines(keepends=True)[:60]))
    command = [sys.executable, "-m", "benchmarks.mixture_sampling", "--input", str(small), "--tokenizer",
               str(corpus["tokenizer"]), "--seq-len", "64", "--rows", "500"]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["rows"] == 500 and report["single_us_per_row"] > 0 and report["mixture_us_per_row"] > 0

"""Benchmarks inside the training loop, on the live ZeRO-3-sharded model.

Every rank calls `run_benchmarks` at the same step with the same settings. Each rank scores its share of the
documents (lm-eval deals them out by rank and gathers the scores to rank 0), with the few-shot prompts one process
would build; every forward pass, which gathers the sharded weights from all ranks, is matched on every rank, padded
with dummy forwards where a rank has fewer batches, and generation runs with `synced_gpus` (`eval.sharded`).

lm-eval seeds Python's, NumPy's and torch's generators; the training RNG states are put back afterwards, and
the model is returned to training mode. A failing benchmark is logged and training continues.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import numpy as np
import torch

from eval.agreement import EvaluationStopped, FailedOnAnotherRank
from eval.harness import (
    BenchmarkSettings,
    PromptLengths,
    evaluate,
    format_table,
    headline_scores,
    write_results,
    write_samples,
)

logger = logging.getLogger("eval")


def capture_rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def benchmark_timings(results: dict, seconds: float) -> dict[str, float]:
    """Seconds in all, per document, and per MMLU document (its scoring: loglikelihood requests) and per GSM8K
    document (its generations): what `recipes.planning.eval_cost` prices."""
    samples = {task: n["effective"] for task, n in results["n-samples"].items()}
    documents = sum(samples.values())
    timings = {"benchmark_seconds": seconds, "benchmark_seconds_per_document": seconds / max(documents, 1)}
    measured = results.get("timings", {})
    mmlu = sum(count for task, count in samples.items() if task.startswith("mmlu"))
    gsm8k = sum(count for task, count in samples.items() if task.startswith("gsm8k"))
    if mmlu and measured.get("loglikelihood_requests"):
        timings["mmlu_seconds_per_document"] = measured["loglikelihood_s"] / mmlu
    if gsm8k and measured.get("generate_until_requests"):
        timings["gsm8k_seconds_per_document"] = measured["generate_until_s"] / gsm8k
    return timings


def run_benchmarks(model, accelerator, tokenizer, settings: BenchmarkSettings, step: int, output_dir: Path,
                   stop_requested=None) -> dict:  # fmt: skip
    """Scores (`mmlu/acc`, `gsm8k/exact_match_strict`, ...), the same on every rank, or {} when a benchmark failed or
    `stop_requested()` turned true on a rank (asked before every forward pass: a full evaluation at 70B takes hours,
    more than a time limit's warning). The main process writes `output_dir/eval/step-N.json`. A collective: call it
    on every rank."""
    if accelerator.is_main_process:
        logger.info("step %d: benchmarks started (%s)", step, ", ".join(settings.tasks))
    rng = capture_rng_state()
    was_training = model.training
    model.eval()
    started = time.perf_counter()
    results, failure = None, ""  # None: left because another rank failed
    try:
        results = evaluate(
            accelerator.unwrap_model(model),
            tokenizer,
            settings,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            stop_requested=stop_requested,
        )
    except EvaluationStopped:
        logger.warning("step %d: benchmarks stopped by a stop signal after %.1f s, not scored", step,
                       time.perf_counter() - started)  # fmt: skip
        return {}
    except FailedOnAnotherRank:
        failure = None  # the failed rank says why
    except Exception as error:  # a benchmark must never end a run of weeks
        failure = f"{type(error).__name__}: {error}"
    finally:
        restore_rng_state(rng)
        if was_training:
            model.train()
    from accelerate.utils import broadcast_object_list, gather_object

    failures = {rank: said for rank, said in enumerate(gather_object([failure])) if said != ""}
    seconds = time.perf_counter() - started
    if failures:
        failed = {rank: said for rank, said in failures.items() if said}
        if accelerator.is_main_process:
            logger.error("step %d: benchmarks failed on rank(s) %s, training continues: %s", step,
                         ", ".join(map(str, failed)), next(iter(failed.values()), "unknown"))  # fmt: skip
        return {}
    # lm-eval gathers every rank's scores to rank 0 and aggregates there; the others get None. Whatever fails on the
    # main process now (a full disk, a bug) is logged: the other ranks are already waiting in the broadcast.
    scores = [None]
    if accelerator.is_main_process:
        try:
            scores = [main_process_scores(results, step, seconds)]
        except Exception as error:
            logger.error("step %d: benchmark scores could not be computed, training continues: %s: %s", step,
                         type(error).__name__, error)  # fmt: skip
            scores = [{}]
        try:
            write_step_results(results, step, seconds, output_dir)
        except Exception as error:
            logger.error("step %d: benchmark results not written to %s, training continues (the scores go to the "
                         "metrics): %s: %s", step, output_dir / "eval", type(error).__name__, error)  # fmt: skip
    return broadcast_object_list(scores)[0]


def main_process_scores(results: dict, step: int, seconds: float) -> dict:
    """The headline scores, timings and truncated-prompt count of an evaluation's results (lm-eval's, on rank 0)."""
    lengths = PromptLengths(**results["prompt_lengths"])
    if lengths.warning(f"step {step}"):
        logger.warning("%s", lengths.warning(f"step {step}"))
    return {**headline_scores(results), **benchmark_timings(results, seconds),
            "benchmark_truncated_prompts": lengths.truncated}  # fmt: skip


def write_step_results(results: dict, step: int, seconds: float, output_dir: Path) -> None:
    """`eval/step-N.json` (and its samples), and the table in the log."""
    documents = sum(n["effective"] for n in results["n-samples"].values())
    samples = results.pop("samples", None)
    write_results(results, output_dir / "eval" / f"step-{step}.json")
    if samples is not None:
        write_samples(samples, output_dir / "eval" / f"step-{step}-samples.jsonl")
    logger.info("step %d: benchmarks (%d documents, %.1f s)\n%s", step, documents, seconds, format_table(results))

"""Run metrics: throughput, MFU, memory, and the writers (console, metrics.jsonl, TensorBoard, loss.png).

Only the main process writes; every function that needs numbers from all ranks takes them
already reduced.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from common.files import atomic_write_text
from common.process import peak_rss_bytes
from recipes.telemetry import trackers


def tokens_per_second(tokens_all_ranks: int, seconds: float) -> float:
    """Real tokens consumed by all ranks together over a wall-clock duration."""
    return tokens_all_ranks / seconds if seconds > 0 else 0.0


def model_flops_utilization(
    tokens_per_s: float, flops_per_token: float, world_size: int, peak_tflops_per_device: float | None
) -> float | None:
    if not peak_tflops_per_device:
        return None
    return tokens_per_s * flops_per_token / (world_size * peak_tflops_per_device * 1e12)


def host_memory_gb() -> float:
    """Resident memory of this process now."""
    return psutil.Process().memory_info().rss / 1e9


def peak_host_memory_gb() -> float:
    """Peak resident memory of this process so far."""
    return peak_rss_bytes() / 1e9


def peak_gpu_memory_gb() -> float | None:
    """Peak CUDA memory allocated by this process; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 1e9


def strict_json(record: dict[str, Any]) -> dict[str, Any]:
    """The record with each non-finite float as null: JSON has no Infinity or NaN (an fp16 overflow step's gradient
    norm is inf), and Python's `json` writes them as bare words that jq and JSON.parse refuse."""
    return {
        key: None if isinstance(value, float) and not math.isfinite(value) else value for key, value in record.items()
    }


class MetricsWriter:
    """Where the run's numbers go. On the main process: metrics.jsonl (one JSON object per line, the source of
    truth) and the experiment trackers (`accelerator.log`: TensorBoard, wandb, MLflow per `report_to`). On every
    node's local rank 0 with a Prometheus exporter: its latest values. Call `write` on every rank alike."""

    def __init__(self, output_dir: str | Path, enabled: bool, prometheus=None, trackers=None, lingers: bool = False):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.prometheus = prometheus  # recipes.telemetry.monitoring.PrometheusExporter, or None
        self.trackers = trackers  # an Accelerator whose trackers were started, or None
        # every rank of a run with an endpoint waits while it serves the exit code: a rank exiting first (exit 2-5)
        # makes the launcher end the others, the serving one among them
        self.lingers = lingers

    def write(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, **values}
        if self.prometheus is not None:
            self.prometheus.update(record)
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        if self.trackers is not None:
            numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if numbers:
                trackers.log(self.trackers.trackers, numbers, step)

    def live(self, values: dict[str, Any]) -> None:
        """Values for the Prometheus endpoint only, not for metrics.jsonl (a state, such as benchmarks running)."""
        if self.prometheus is not None:
            self.prometheus.update(values)

    def truncate(self, after_step: int) -> None:
        """Drop the records past `after_step` (a resumed or rolled-back run logs those steps again)."""
        if self.enabled:
            truncate_metrics(self.path, after_step)

    def close(self, exit_code: int | None = None, linger_s: float = 0.0) -> None:
        """Stop the Prometheus endpoint, after serving the run's `exit_code` for `linger_s` seconds."""
        if self.prometheus is not None:
            self.prometheus.close(exit_code, linger_s)
            self.prometheus = None
        elif self.lingers and exit_code is not None:
            time.sleep(max(linger_s, 0.0))


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) for each line that parses. A line that does not (the torn last line of a run killed
    mid-write, typically) is dropped with a warning instead of making every later resume fail."""
    import logging

    kept = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            logging.getLogger("pretrain").warning(
                "%s:%d is not a metrics record (torn by a kill?); dropped", path, number
            )
            continue
        kept.append((line, record))
    return kept


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    return [record for _, record in _records(path)] if path.exists() else []


def truncate_metrics(path: str | Path, after_step: int) -> None:
    """Drop records past `after_step`: a resumed run logs those steps again, and the file keeps one history."""
    path = Path(path)
    if not path.exists():
        return
    kept = [line for line, record in _records(path) if record["step"] <= after_step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def plot_losses(metrics_path: str | Path, output_png: str | Path) -> None:
    """Training loss per logged step, and eval_loss where it was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(output_png, dpi=110)
    plt.close(fig)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


THROUGHPUT_DEFINITION = (
    "tokens of the training steps / their wall time, evaluation and saving excluded: the median of the logged "
    "windows after the first, which holds start-up"
)


def steady_median(records: list[dict[str, Any]], key: str) -> float | None:
    """The median of `key` over the logged windows after the first (all of them when there is one)."""
    windows = [r[key] for r in records if r.get(key) is not None]
    return _median(windows[1:] or windows) if windows else None


PLAN_QUANTITIES = {
    "step_time_s": "step time (s)",
    "tokens_per_s": "tokens/s (all ranks)",
    "peak_gpu_memory_gb": "peak GPU memory per GPU (GB)",
    "peak_host_memory_gb_per_node": "peak host memory per node (GB)",
}


def plan_vs_measured(predictions: dict[str, float | None], records: list[dict[str, Any]],
                     host_peaks_gb: dict[str, float]) -> list[dict[str, Any]]:  # fmt: skip
    """Each planned quantity beside what the run measured: the median step time and tokens/s over the logged
    windows (the first window, which includes start-up, is left out when there are others), the largest peak GPU
    memory any rank logged, and the largest per-node sum of the ranks' peak resident memory."""
    train = [r for r in records if "tokens_per_s" in r]
    gpu = [r["peak_gpu_memory_gb"] for r in records if r.get("peak_gpu_memory_gb")]
    measured = {
        "step_time_s": steady_median(train, "step_time_s"),
        "tokens_per_s": steady_median(train, "tokens_per_s"),
        "peak_gpu_memory_gb": max(gpu) if gpu else None,
        "peak_host_memory_gb_per_node": max(host_peaks_gb.values()) if host_peaks_gb else None,
    }
    return [
        {"quantity": key, "plan": predictions.get(key), "measured": measured[key],
         "ratio": measured[key] / predictions[key] if measured[key] and predictions.get(key) else None}
        for key in PLAN_QUANTITIES
    ]  # fmt: skip


def _plan_table(rows: list[dict[str, Any]]) -> list[str]:
    def cell(value, digits=2):
        return "n/a" if value is None else f"{value:,.{digits}f}"

    lines = ["", "## Plan vs measured", "", "| quantity | plan | measured | measured / plan |", "|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {PLAN_QUANTITIES[row['quantity']]} | {cell(row['plan'])} | {cell(row['measured'])} | "
                     f"{cell(row['ratio'])} |")  # fmt: skip
    lines.append("")
    lines.append("n/a: not planned (no peak or hardware profile) or not measurable here (no CUDA).")
    return lines


def run_report(output_dir: str | Path) -> str:
    """A short Markdown report of a run from its metrics.jsonl and run_summary.json."""
    output_dir = Path(output_dir)
    records = read_metrics(output_dir / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    summary_path = output_dir / "run_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    lines = [f"# Run report: {output_dir}", ""]
    if not train:
        return "\n".join([*lines, "No training step was logged."]) + "\n"
    # The run's totals are run_summary.json's (the run's own counters); metrics.jsonl gives the curves.
    lines += [
        f"- steps: {summary.get('steps', train[-1]['step'])} ({summary.get('stop_reason', 'stop reason unknown')})",
        f"- train loss: {train[0]['loss']:.4f} (step {train[0]['step']}) -> {train[-1]['loss']:.4f} "
        f"(step {train[-1]['step']})",
    ]
    if evals:
        best = min(evals, key=lambda r: r["eval_loss"])
        trail = " -> ".join(f"{r['eval_loss']:.4f} (step {r['step']})" for r in evals)
        lines += [f"- eval loss: {trail}", f"- best eval loss: {best['eval_loss']:.4f} at step {best['step']}"]
    tokens_per_s = summary.get("tokens_per_s") or steady_median(train, "tokens_per_s")
    lines.append(f"- throughput: {tokens_per_s:,.0f} tokens/s over all ranks ({THROUGHPUT_DEFINITION})")
    mfus = [r for r in train if r.get("mfu") is not None]
    if mfus:
        lines.append(f"- MFU: {steady_median(mfus, 'mfu'):.1%} (the same windows)")
    tokens = summary.get("num_tokens", train[-1].get("num_tokens"))
    if tokens:
        lines.append(f"- tokens consumed: {tokens:,}")
    changes = [r for r in records if "previous_world_size" in r]
    if changes:
        trail = "; ".join(f"step {r['step']}: {r['previous_world_size']} -> {r['world_size']} ranks (accumulation "
                          f"{r['previous_gradient_accumulation_steps']} -> {r['gradient_accumulation_steps']})"
                          for r in changes)  # fmt: skip
        lines.append(f"- world size changes (global batch kept): {trail}")
    if "peak_host_memory_gb_per_rank" in summary:
        peaks = ", ".join(f"rank {i} {gb:.2f} GB" for i, gb in enumerate(summary["peak_host_memory_gb_per_rank"]))
        lines.append(f"- peak host memory: {peaks}")
    if "wall_seconds" in summary:
        launches = summary.get("launches")
        over = f" over {launches} launch{'es' if launches != 1 else ''}" if launches else ""
        lines.append(f"- wall time: {summary['wall_seconds']:.0f} s{over} (start-up, steps, evaluations and saves; "
                     "work redone after a restart counted once)")  # fmt: skip
    lines += _benchmark_lines(records, summary)
    if summary.get("plan_vs_measured"):
        lines += _plan_table(summary["plan_vs_measured"])
    return "\n".join(lines) + "\n"


def write_run_outputs(output_dir: str | Path, final_dir: Path | None, summary: dict[str, Any]) -> None:
    """loss.png, run_summary.json and report.md at the end of a launch (final_dir None: stopped, to be continued),
    and where they are (main process)."""
    import logging

    logger = logging.getLogger("pretrain")
    output_dir = Path(output_dir)
    plot_losses(output_dir / "metrics.jsonl", output_dir / "loss.png")
    (output_dir / "run_summary.json").write_text(json.dumps(summary, indent=2))
    (output_dir / "report.md").write_text(run_report(output_dir))
    if final_dir is not None:
        logger.info("model: %s", final_dir)
    logger.info("metrics: %s (TensorBoard: %s)", output_dir / "metrics.jsonl", output_dir / "tensorboard")
    logger.info("loss plot: %s", output_dir / "loss.png")


def _benchmark_lines(records: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """The report's lines on the in-loop benchmarks: each score over the run, and what an evaluation costs."""
    lines: list[str] = []
    mmlu = [r for r in records if "mmlu/acc" in r]
    if mmlu:
        trail = " -> ".join(f"{r['mmlu/acc']:.4f} (step {r['step']})" for r in mmlu)
        lines.append(f"- MMLU accuracy (lm-eval, weighted over subjects): {trail}")
    gsm8k = [r for r in records if "gsm8k/exact_match_strict" in r]
    if gsm8k:
        trail = " -> ".join(
            f"{r['gsm8k/exact_match_strict']:.4f} / {r['gsm8k/exact_match_flexible']:.4f} (step {r['step']})"
            for r in gsm8k
        )
        lines.append(f"- GSM8K exact match (lm-eval, strict / flexible extraction): {trail}")
    timed = [r for r in records if "benchmark_seconds_per_document" in r]
    if timed:
        ranks = summary.get("world_size")
        split = f"the documents split over {ranks} ranks" if ranks else "the documents split over the ranks"
        truncated = sum(r.get("benchmark_truncated_prompts", 0) for r in timed)
        lines.append(
            f"- benchmark time: {timed[-1]['benchmark_seconds']:.1f} s per evaluation, "
            f"{timed[-1]['benchmark_seconds_per_document']:.2f} s per document ({split})"
            + (f"; {truncated:,} prompts cut to the model's positions" if truncated else "")
        )
    return lines

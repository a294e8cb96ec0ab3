"""How a plan is said: the text report, its JSON, and what a number of days buys."""

from __future__ import annotations

from typing import Any

from recipes.config import (
    PretrainConfig,
)
from recipes.planning.memory import CHECKPOINT_WRITE_GB_PER_S_PER_RANK, SHA256_GB_PER_S
from recipes.planning.plan import Plan
from recipes.planning.step_time import (
    chinchilla,
)
from recipes.planning.units import format_duration, format_total, gb_text, parameters, si


def format_plan(plan: Plan, config: PretrainConfig) -> str:
    h = plan.hardware
    devices, device = h["devices"], h["device"]
    lines = [
        f"plan for a {plan.num_layers}-layer Llama, {parameters(plan.params)} parameters, on {h['gpus']} {devices} / "
        f"{h['nodes']} node(s)",
        f"  steps: {plan.total_steps:,}; warmup {config.warmup_steps:,} steps = {plan.warmup_fraction:.2%}",
        f"  FLOPs per token: {si(plan.flops_per_token)} ({si(plan.hardware_flops_per_token)} with recomputation)",
    ]
    leaves = ", ".join(config.zero3_leaf_modules) or "none: every module"
    lines.append(f"  ZeRO-3 granularity: hooks on {plan.hooked_modules:,} modules with parameters (leaf modules: "
                 f"{leaves}); at most {parameters(plan.largest_layer_params)} parameters gathered at once")  # fmt: skip
    if plan.step_time_breakdown_s:
        lines += format_breakdown(plan)
    if plan.peak_tokens_per_s:
        at = f"{h['mfu']:.0%} MFU (--mfu)" if h["mfu"] is not None else f"the modelled {plan.predicted_mfu:.1%} MFU"
        lines += [
            f"  tokens/s: ceiling {plan.peak_tokens_per_s:,.0f} at 100% MFU; expected "
            f"{plan.expected_tokens_per_s:,.0f} at {at} ({plan.expected_tokens_per_s / h['gpus']:,.0f}/{device})",
            f"  step time: {plan.step_time_s:.1f} s; total: {format_total(plan.expected_days * 86_400)}, "
            f"{si(plan.gpu_hours)} {device}-hours; with the benchmarks and the saves: "
            f"{format_total(plan.wall_days * 86_400)}",
        ]
    lines.append(f"  memory per {device if device == 'GPU' else 'process, as on a GPU'} (GB):")
    lines += [f"    {name:28s} {value:8.2f}" for name, value in plan.per_gpu_memory_gb.items()]
    lines.append(f"    (DeepSpeed model states: {plan.model_states_gpu_gb:.2f})")
    lines.append(f"  host memory per node: {gb_text(plan.host_memory_per_node_gb)}")
    lines += [f"    {name:28s} {value:8.1f}" for name, value in plan.host_memory_terms_gb.items()]
    conversion = (f", {gb_text(plan.conversion_disk_gb)} more while an elastic resume converts one"
                  if plan.conversion_disk_gb else "")  # fmt: skip
    lines.append(
        f"  checkpoint: {gb_text(plan.checkpoint_gb)} each; {gb_text(plan.checkpoint_disk_gb)} of disk for "
        f"save_total_limit={config.save_total_limit} plus the one being written{conversion}; verified at resume in "
        f"~{format_duration(plan.checkpoint_verify_s)} (sha256, every rank its share at {SHA256_GB_PER_S} GB/s); a "
        f"save takes ~{format_duration(plan.checkpoint_save_s)} (write at {CHECKPOINT_WRITE_GB_PER_S_PER_RANK} GB/s "
        "per rank, then hash)"
    )
    if plan.eval_seconds is not None:
        documents = ", ".join(f"{task} {count:,}" for task, count in plan.eval_documents.items())
        share = f", {plan.eval_share:.1%} of the training between evaluations" if plan.eval_share is not None else ""
        lines.append(
            f"  benchmarks per evaluation: {documents} documents; {plan.eval_forward_passes:,} forward passes per "
            f"rank (each gathers the model); ~{format_duration(plan.eval_seconds)}{share}"
        )
    if plan.eval_batch_fits is not None:
        lines.append(
            f"  evaluation batch: {config.per_device_eval_batch_size} per GPU; {plan.eval_batch_fits} fit in the memory"
            " left while evaluating (no optimizer step, no activations kept for a backward)"
        )
    lines += [f"  verdict: {v}" for v in plan.verdicts]
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def format_breakdown(plan: Plan) -> list[str]:
    h, t = plan.hardware, plan.step_time_breakdown_s
    accumulation, busy = plan.accumulation, max(t["compute"], t["host"])
    wires = ", ".join(f"{k} {v:g}" for k, v in plan.wires.items())
    return [
        f"  step-time model ({h['profile']}"
        + (f", {h['interconnect']}" if h.get("interconnect") else "")
        + f"; {wires}):",
        f"    per micro-batch: compute {t['compute']:.2f} s, ZeRO-3 host hooks {t['host']:.2f} s, communication "
        f"{t['communication']:.2f} s "
        f"({plan.bound}-bound), exposed after overlap {t['exposed_communication']:.2f} s",
        f"    per step: {accumulation} micro-batch(es) x {busy + t['exposed_communication']:.2f} s"
        + (f" + CPU Adam and upload {t['optimizer']:.2f} s" if t["optimizer"] else "")
        + f" = {plan.modelled_step_s:.1f} s; predicted MFU {plan.predicted_mfu:.1%}",
    ]


def json_summary(plan: Plan) -> dict[str, Any]:
    """The keys the issue tracker and scripts rely on, plus everything else the plan knows."""
    full = plan.to_json()
    return {
        "params": plan.params,
        "total_steps": plan.total_steps,
        "warmup_fraction": plan.warmup_fraction,
        "flops_per_token": plan.flops_per_token,
        "per_gpu_memory_gb": plan.per_gpu_memory_gb,
        "host_memory_per_node_gb": plan.host_memory_per_node_gb,
        "peak_tokens_per_s": plan.peak_tokens_per_s,
        "expected_tokens_per_s": plan.expected_tokens_per_s,
        "step_time_breakdown_s": plan.step_time_breakdown_s,
        "predicted_mfu": plan.predicted_mfu,
        "expected_days": plan.expected_days,
        "gpu_hours": plan.gpu_hours,
        "checkpoint_gb": plan.checkpoint_gb,
        "eval_forward_passes": plan.eval_forward_passes,
        "eval_seconds": plan.eval_seconds,
        "eval_share": plan.eval_share,
        "fits": plan.fits,
        "warnings": plan.warnings,
        **{k: v for k, v in full.items() if k not in ("warnings",)},
    }


def reachable(plan: Plan, days: float) -> dict[str, float]:
    """What `days` on this hardware buy: tokens at the expected rate, and for that compute (6·N·D FLOPs at the
    same rate) the compute-optimal model size and tokens (Chinchilla, ~20 tokens per parameter)."""
    tokens = plan.expected_tokens_per_s * days * 86_400
    params, optimal_tokens = chinchilla(6 * plan.params * tokens)
    return {"days": days, "reachable_tokens": tokens, "compute_optimal_params": params,
            "compute_optimal_tokens": optimal_tokens}  # fmt: skip


def format_reachable(numbers: dict[str, float], plan: Plan) -> str:
    return (
        f"  in {numbers['days']:g} days: {numbers['reachable_tokens'] / 1e9:,.1f}B tokens for this "
        f"{plan.params / 1e9:.1f}B model ({numbers['reachable_tokens'] / plan.params:.2f} tokens per parameter); "
        f"the same compute is spent best (Chinchilla, 20 tokens/parameter) on a "
        f"{numbers['compute_optimal_params'] / 1e9:.1f}B model with {numbers['compute_optimal_tokens'] / 1e9:,.0f}B "
        "tokens"
    )

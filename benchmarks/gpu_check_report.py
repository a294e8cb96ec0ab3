"""The GPU check's judgement and its reports: memory against the plan by group, targets against the measurements,
the markdown table and the row for docs/gpu-results.md (benchmarks/gpu_check.py runs the stages)."""

from __future__ import annotations

import json
from typing import Any

# The targets: the recipe's MFU >= 30 % of the GPU's dense bf16 peak, and its loop >= 0.95x the bare loop's
# throughput; peak reserved memory within 15 % of the plan is the planner's own bar (docs/gpu-results.md).
TARGETS = {"mfu": 0.30, "recipe_over_bare_throughput": 0.95, "memory_within": 0.15}


PERSISTENT_TERMS = ("bf16_parameter_shard", "optimizer_states", "fp32_gradient_partition", "bf16_gradient_shard")


STEP_TERMS = ("largest_layer_gathered", "reduce_bucket", "prefetch_bucket", "live_parameters", "activations", "logits")


def memory_against_plan(measured: dict[str, Any], plan_memory: dict[str, float]) -> dict[str, Any]:
    """Measured peak memory beside the plan, in the groups torch's allocator can see: what stays between steps
    (parameters, optimizer states, gradient partitions) and what one step adds on top (gathered parameters,
    buckets, activations, logits). The plan's total less its CUDA context is compared with the peak reserved."""
    persistent = sum(plan_memory[k] for k in PERSISTENT_TERMS)
    step = sum(plan_memory[k] for k in STEP_TERMS)
    plan_allocator = plan_memory["total"] - plan_memory["cuda_context"]
    rows = {"plan_total_gb": plan_memory["total"], "plan_allocator_gb": plan_allocator,
            "plan_persistent_gb": persistent, "plan_step_gb": step}  # fmt: skip
    if measured.get("peak_reserved_gb") is None:
        return rows
    measured_persistent = measured["steady_allocated_gb"]
    measured_step = measured["peak_allocated_gb"] - measured_persistent
    rows.update(
        measured_persistent_gb=measured_persistent,
        measured_step_gb=measured_step,
        reserved_over_plan=measured["peak_reserved_gb"] / plan_allocator,
        persistent_over_plan=measured_persistent / persistent,
        step_over_plan=measured_step / step if step else None,
    )
    off = {"persistent states": rows["persistent_over_plan"], "one step's additions": rows["step_over_plan"]}
    worst = max(off, key=lambda k: abs((off[k] or 1.0) - 1.0))
    rows["within_target"] = abs(rows["reserved_over_plan"] - 1.0) <= TARGETS["memory_within"]
    rows["term_off"] = None if rows["within_target"] else f"{worst} ({off[worst]:.2f}x the plan)"
    return rows


def run_label(run: dict[str, Any]) -> str:
    """`mb2, checkpointing on, leaf layers` for a training run."""
    granularity = "" if "leaves" not in run else (", leaf layers" if run["leaves"] else ", per-module hooks")
    return f"mb{run['micro_batch']}, checkpointing {'on' if run['gradient_checkpointing'] else 'off'}{granularity}"


def judge(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target beside its measured value (GPU runs only)."""
    targets = []
    runs = [run for run in results["stages"].get("training", []) if not run.get("out_of_memory")]
    timed = [r for r in runs if "recipe_mfu" in r and r.get("bare_s_per_step")]
    if timed:
        best = max(timed, key=lambda r: r["recipe_mfu"] or 0.0)
        targets.append({"target": f"recipe MFU >= {TARGETS['mfu']:.0%} ({run_label(best)})",
                        "value": best["recipe_mfu"], "met": (best["recipe_mfu"] or 0.0) >= TARGETS["mfu"]})  # fmt: skip
        for run in timed:
            ratio = run["bare_s_per_step"] / run["recipe_s_per_step"]
            targets.append({"target": f"recipe >= {TARGETS['recipe_over_bare_throughput']}x bare ({run_label(run)})",
                            "value": ratio, "met": ratio >= TARGETS["recipe_over_bare_throughput"]})  # fmt: skip
    for run in runs:
        memory = run.get("plan_memory", {})
        if "reserved_over_plan" in memory:
            targets.append({"target": f"peak reserved within {TARGETS['memory_within']:.0%} of plan ({run_label(run)})",
                            "value": memory["reserved_over_plan"], "met": memory["within_target"],
                            "term_off": memory.get("term_off")})  # fmt: skip
    for check in results["stages"].get("attention", {}).get("checks", []):
        targets.append({"target": f"attention {check['attn_implementation']} ({check['kernel']}) path "
                        f"{check['expected_path']}, packed = alone within {check['tolerance']}",
                        "value": check["max_abs_diff"], "met": check["ok"]})  # fmt: skip
    return targets


def render_markdown(results: dict[str, Any]) -> str:
    def cell(value, digits=3):
        if value is None:
            return "n/a"
        return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)

    env = results["stages"].get("environment", {})
    lines = ["# GPU check" + (" (CPU dry run: no GPU result)" if results["dry_run"] else ""), ""]
    if env:
        lines += ["| " + " | ".join(env) + " |", "|" + "---|" * len(env), "| " + " | ".join(map(cell, env.values())) +
                  " |", ""]  # fmt: skip
    lines += _training_lines(results["stages"].get("training", []), cell)
    deepcompile = results["stages"].get("deepcompile")
    if deepcompile:
        lines += ["## DeepCompile", ""]
        if deepcompile.get("ran"):
            lines.append(f"micro-batch 2, leaf layers: bare {cell(deepcompile.get('bare_s_per_step'))} s/step, recipe "
                         f"{cell(deepcompile.get('recipe_s_per_step'))} s/step, recipe MFU "
                         f"{cell(deepcompile.get('recipe_mfu'))}")  # fmt: skip
        else:
            lines.append(f"not run: {deepcompile.get('reason')}")
        lines.append("")
    attention = results["stages"].get("attention")
    if attention:
        lines += ["## Attention", "", "| implementation | kernel | micro-batch | path | expected | max abs diff | ok |",
                  "|---|---|---:|---|---|---:|---|"]  # fmt: skip
        for check in attention["checks"]:
            lines.append(f"| {check['attn_implementation']} | {check['kernel']} | {check['micro_batch']} | "
                         f"{check['path']} | {check['expected_path']} | {check['max_abs_diff']:.2e} | "
                         f"{check['ok']} |")  # fmt: skip
        lines += ["", "| implementation, masking on, mb2 | s/step | tokens/s | MFU |", "|---|---:|---:|---:|"]
        for timing in attention.get("timings", []):
            if timing["ran"]:
                lines.append(f"| {timing['attn_implementation']} | {cell(timing['s_per_step'])} | "
                             f"{cell(timing['tokens_per_s'], 0)} | {cell(timing['mfu'])} |")  # fmt: skip
            else:
                lines.append(f"| {timing['attn_implementation']} | not run: {timing['reason']} | | |")
        first = attention["first_losses"]
        lines += ["", f"first losses, flash_attention_2 against sdpa: {json.dumps(first)}", ""]
    e2e = results["stages"].get("end_to_end")
    if e2e:
        lines += ["## End to end (recipes/pretrain.py)", "", f"exit code {e2e['exit_code']} in {e2e['seconds']} s; "
                  f"{e2e['attention_line'] or ''}", "", "| benchmark | measured s/document | plan s/document |",
                  "|---|---:|---:|",
                  f"| MMLU | {cell(e2e['mmlu_seconds_per_document'])} | "
                  f"{cell(e2e['plan_mmlu_seconds_per_document'])} |",
                  f"| GSM8K | {cell(e2e['gsm8k_seconds_per_document'])} | "
                  f"{cell(e2e['plan_gsm8k_seconds_per_document'])} |", ""]  # fmt: skip
    if results["targets"]:
        lines += ["## Targets", "", "| target | measured | met |", "|---|---:|---|"]
        lines += [f"| {t['target']} | {cell(t['value'])} | {'yes' if t['met'] else 'no'} |" for t in results["targets"]]
        lines.append("")
    if results["skipped"]:
        lines += ["## Skipped", ""] + [f"- {s['stage']}: {s['reason']}" for s in results["skipped"]] + [""]
    return "\n".join(lines)


def _training_lines(runs: list[dict[str, Any]], cell) -> list[str]:
    if not runs:
        return []
    lines = ["## Training", "", "| micro-batch | checkpointing | ZeRO-3 hooks | attention | bare s/step | "
             "recipe s/step | recipe tokens/s | recipe MFU | plan MFU | steady GB | peak alloc GB | peak reserved GB | "
             "plan GB (allocator) | reserved / plan | term off |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for run in runs:
        hooks = "" if "leaves" not in run else ("leaf layers" if run["leaves"] else "per module")
        if run.get("out_of_memory"):
            lines.append(f"| {run['micro_batch']} | {'on' if run['gradient_checkpointing'] else 'off'} | {hooks} | "
                         "out of memory | | | | | | | | | | | |")  # fmt: skip
            continue
        memory = run.get("plan_memory", {})
        lines.append(
            f"| {run['micro_batch']} | {'on' if run['gradient_checkpointing'] else 'off'} | {hooks} | "
            f"{run['attn_implementation']} | {cell(run.get('bare_s_per_step'))} | "
            f"{cell(run.get('recipe_s_per_step'))} | {cell(run.get('recipe_tokens_per_s'), 0)} | "
            f"{cell(run.get('recipe_mfu'))} | {cell(run.get('plan_mfu'))} | "
            f"{cell(run.get('steady_allocated_gb'), 2)} | "
            f"{cell(run.get('peak_allocated_gb'), 2)} | {cell(run.get('peak_reserved_gb'), 2)} | "
            f"{cell(memory.get('plan_allocator_gb'), 2)} | {cell(memory.get('reserved_over_plan'), 2)} | "
            f"{memory.get('term_off') or ''} |"
        )
    return [*lines, ""]


def docs_row(results: dict[str, Any]) -> str:
    """One row for docs/gpu-results.md."""
    env = results["stages"].get("environment", {})
    runs = [run for run in results["stages"].get("training", []) if not run.get("out_of_memory")]
    timed = [r for r in runs if r.get("recipe_mfu") is not None]
    mfu = ", ".join(f"{run_label(r)}: {r['recipe_mfu']:.1%} (bare {r['bare_mfu']:.1%})" for r in timed)
    memory = ", ".join(f"{run_label(r)}: {r['peak_reserved_gb']:.1f} GB "
                       f"({r['plan_memory'].get('reserved_over_plan', 0):.2f}x plan)"
                       for r in runs if r.get("peak_reserved_gb") is not None)  # fmt: skip
    met = sum(t["met"] for t in results["targets"])
    cells = [env.get("date"), env.get("gpu"), env.get("driver"), env.get("cuda"), env.get("torch"),
             env.get("flash_attn") or "not installed", env.get("deepspeed"), env.get("transformers"), mfu, memory,
             f"{met}/{len(results['targets'])} targets met"]  # fmt: skip
    return "| " + " | ".join(str(c) if c not in (None, "") else "n/a" for c in cells) + " |"

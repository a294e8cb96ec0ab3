"""`python -m recipes.plan --tokens T --days D`: the smallest cluster of the recipe's node type that trains T tokens
in D days, and `--search --max-nodes N`: the best configuration at every node count.

A cluster here is N nodes of the recipe's hardware (its GPUs per node, profile and interconnect). At each N the
planner runs `--search`'s grid (micro-batch, checkpointing, optimizer and parameter offload, ZeRO++ with hpZ across
nodes) through the same memory and communication model as every plan, and keeps the fastest configuration that fits.
Only node counts whose GPUs can keep the recipe's global batch are candidates (rows divisible by GPUs x micro-batch:
128 rows on 8-GPU nodes allow 1, 2, 4, 8 and 16 nodes); a deadline that needs more says which global batch would
allow it. Pure arithmetic, like every plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from recipes.config import ConfigError, PretrainConfig
from recipes.planning.plan import Plan
from recipes.planning.search import Choice, search
from recipes.planning.units import si

SECONDS_PER_DAY = 86_400
DEFAULT_MAX_NODES = 128


@dataclass(frozen=True)
class Cluster:
    """The fastest configuration that fits on `nodes` nodes."""

    nodes: int
    gpus: int
    choice: Choice
    plan: Plan

    @property
    def tokens_per_s(self) -> float:
        return self.plan.expected_tokens_per_s

    def days(self, tokens: float) -> float:
        return tokens / self.tokens_per_s / SECONDS_PER_DAY

    def gpu_hours(self, tokens: float) -> float:
        return self.gpus * self.days(tokens) * 24

    def summary(self, tokens: float) -> dict[str, Any]:
        return {
            "nodes": self.nodes, "gpus": self.gpus, "tokens_per_s": self.tokens_per_s, "days": self.days(tokens),
            "gpu_hours": self.gpu_hours(tokens), "mfu": self.plan.predicted_mfu,
            "per_gpu_memory_gb": self.plan.per_gpu_memory_gb["total"], "variant": self.choice.label(),
        }  # fmt: skip


def clusters(config: PretrainConfig, hardware, ds_config: dict[str, Any], max_nodes: int,
             vocab_size: int | None = None) -> list[Cluster]:  # fmt: skip
    """The best configuration at each node count from 1 to `max_nodes` where one fits and keeps the global batch."""
    if max_nodes > 1 and hardware.profile and not (hardware.interconnect or hardware.wires.get("inter_node_gbps")):
        raise ConfigError(
            "clusters of more than one node need the network between them: --interconnect ib100|ib200|ib400|ib800 "
            "or --inter-node-gbps (the 16-GPU recipe's hardware says ib200), or --max-nodes 1"
        )
    per_node = hardware.gpus_per_node
    rows = kept_rows(config, hardware)
    found = []
    for nodes in range(1, max_nodes + 1):
        gpus = nodes * per_node
        if rows % gpus:
            continue  # no micro-batch keeps the global batch on these GPUs
        # the search varies the micro-batch and derives the accumulation from the global batch these fields give
        at_size = dataclasses.replace(config, per_device_train_batch_size=1, gradient_accumulation_steps=rows // gpus,
                                      global_batch_size=rows)  # fmt: skip
        sized = dataclasses.replace(hardware, gpus=gpus, nodes=nodes)
        ranked, _, _ = search(at_size, sized, ds_config, vocab_size=vocab_size)
        if ranked:
            found.append(Cluster(nodes, nodes * per_node, *ranked[0]))
    return found


def kept_rows(config: PretrainConfig, hardware) -> int:
    """The global batch every cluster keeps: `global_batch_size`, else what the recipe gives on its own hardware."""
    return config.global_batch_size or config.resolved_global_batch_size(hardware.gpus)


def smallest_meeting(found: list[Cluster], tokens: float, days: float) -> Cluster | None:
    return next((cluster for cluster in found if cluster.days(tokens) <= days), None)


def deadline_answer(found: list[Cluster], tokens: float, days: float, config: PretrainConfig, hardware,
                    max_nodes: int) -> dict[str, Any]:  # fmt: skip
    """What `--json` gives: the smallest cluster that meets the deadline, or (`met` false) the fastest there is."""
    answer = smallest_meeting(found, tokens, days)
    best = answer or max(found, key=lambda cluster: cluster.tokens_per_s, default=None)
    return {
        "tokens": tokens, "days_wanted": days, "tokens_per_s_needed": tokens / days / SECONDS_PER_DAY,
        "met": answer is not None, "max_nodes": max_nodes, "gpus_per_node": hardware.gpus_per_node,
        "global_batch_rows": kept_rows(config, hardware),
        "searched_nodes": [cluster.nodes for cluster in found],
        **(best.summary(tokens) if best else {"nodes": None, "gpus": None, "tokens_per_s": None, "days": None}),
    }  # fmt: skip


def format_deadline(answer: dict[str, Any], hardware) -> str:
    node = f"{answer['gpus_per_node']}-{hardware.device} nodes" + (f" ({hardware.profile})" if hardware.profile else "")
    lines = [
        f"deadline: {si(answer['tokens'])} tokens in {answer['days_wanted']:g} days needs "
        f"{answer['tokens_per_s_needed']:,.0f} tokens/s",
        f"  searched: 1-{answer['max_nodes']} {node}; global_batch_size {answer['global_batch_rows']} rows allows "
        f"{', '.join(map(str, answer['searched_nodes'])) or 'none'} node(s) with a configuration that fits",
    ]
    if answer["nodes"] is None:
        return "\n".join([*lines, "  no node count fits this recipe: see the plan's verdicts"])
    said = (
        f"{answer['nodes']} node(s), {answer['gpus']} {hardware.devices}: {answer['tokens_per_s']:,.0f} tokens/s "
        f"(MFU {answer['mfu']:.1%}, {answer['per_gpu_memory_gb']:.1f} GB per {hardware.device}), "
        f"{answer['days']:,.1f} days, {si(answer['gpu_hours'])} {hardware.device}-hours; {answer['variant']}"
    )
    if answer["met"]:
        return "\n".join([*lines, f"  smallest that meets it: {said}"])
    gpus_needed = answer["tokens_per_s_needed"] / (answer["tokens_per_s"] / answer["gpus"])  # at this rate per GPU
    return "\n".join([
        *lines,
        f"  none meets it; the fastest: {said}",
        f"  at that rate per {hardware.device}, the deadline needs ~{gpus_needed:,.0f} {hardware.devices}, which only "
        f"a global batch of at least {gpus_needed:,.0f} rows can keep (--global_batch_size; Llama 2 trained with 4M "
        "tokens per step, 2,048 rows of 2,048)",
    ])  # fmt: skip


def format_clusters(found: list[Cluster], tokens: float, hardware) -> str:
    """`--search --max-nodes N`: every node count's best configuration, fastest first."""
    lines = [f"the best configuration at each node count, fastest first ({si(tokens)} tokens):"]
    for cluster in sorted(found, key=lambda cluster: -cluster.tokens_per_s):
        lines.append(
            f"  {cluster.nodes:4d} node(s) {cluster.gpus:5d} {hardware.devices}  {cluster.tokens_per_s:>11,.0f} "
            f"tokens/s  MFU {cluster.plan.predicted_mfu:5.1%}  {cluster.days(tokens):>9,.1f} days  "
            f"{si(cluster.gpu_hours(tokens)):>7} {hardware.device}-hours  {cluster.choice.label()}"
        )
    return "\n".join(lines)

"""`python -m recipes.plan --search`: the configurations of a recipe that fit, ranked by modelled tokens/s.

The grid: micro-batch 1, 2, 4 (accumulation adjusted so the global batch stays the recipe's), gradient
checkpointing every 1, 2 or 4 layers, optimizer offload on/off, parameter offload on/off, ZeRO++ on/off (int8
weight gathers and int4 gradient reduction, and hpZ over each node's GPUs when there are several nodes; not
combined with parameter offload, which DeepSpeed does not support with it). 72 plans of pure arithmetic take
well under a second.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from recipes.config import ConfigError, PretrainConfig

MICRO_BATCHES = (1, 2, 4)
LAYERS_PER_CHECKPOINT = (1, 2, 4)


@dataclass(frozen=True)
class Choice:
    micro_batch: int
    accumulation: int
    layers_per_checkpoint: int
    offload_optimizer: bool
    offload_param: bool
    zeropp: bool

    def label(self) -> str:
        offloads = "+".join(name for name, on in (("optimizer", self.offload_optimizer),
                                                   ("params", self.offload_param)) if on) or "none"  # fmt: skip
        return (f"micro {self.micro_batch} x accum {self.accumulation}, checkpoint every {self.layers_per_checkpoint},"
                f" offload {offloads}, ZeRO++ {'on' if self.zeropp else 'off'}")  # fmt: skip


def with_zero(ds_config: dict[str, Any], choice: Choice, gpus_per_node: int, nodes: int) -> dict[str, Any]:
    """The DeepSpeed JSON with the choice's offloads and ZeRO++ settings (hpZ only across nodes: on one node the
    secondary copy would cost memory and save nothing)."""
    ds = copy.deepcopy(ds_config)
    zero = ds.setdefault("zero_optimization", {})
    on, off = {"device": "cpu", "pin_memory": True}, {"device": "none"}
    zero["offload_optimizer"] = dict(on if choice.offload_optimizer else off)
    zero["offload_param"] = dict(on if choice.offload_param else off)
    for key in ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients"):
        zero.pop(key, None)
    if choice.zeropp:
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
        if nodes > 1:
            zero["zero_hpz_partition_size"] = gpus_per_node
    return ds


def shipped_choice(config: PretrainConfig, ds_config: dict[str, Any]) -> Choice:
    from recipes.config.deepspeed import offloads

    zero = ds_config.get("zero_optimization", {})
    return Choice(
        config.per_device_train_batch_size, config.gradient_accumulation_steps,
        config.gradient_checkpointing_layers_per_checkpoint, offloads(ds_config, "optimizer"),
        offloads(ds_config, "param"),
        int(zero.get("zero_hpz_partition_size", 1)) > 1 or bool(zero.get("zero_quantized_weights")),
    )  # fmt: skip


def search(config: PretrainConfig, hardware, ds_config: dict[str, Any], vocab_size: int | None = None):
    """(ranked (choice, plan) pairs that fit, the shipped choice, its rank from 1 or None when it does not fit)."""
    from recipes.planning.plan import make_plan

    world = hardware.gpus
    rows = config.resolved_global_batch_size(world)
    ranked = []
    for micro, every, optimizer, param, zeropp in itertools.product(
        MICRO_BATCHES, LAYERS_PER_CHECKPOINT, (True, False), (True, False), (True, False)
    ):
        if rows % (micro * world) or (zeropp and param):
            continue
        choice = Choice(micro, rows // (micro * world), every, optimizer, param, zeropp)
        candidate = dataclasses.replace(config, per_device_train_batch_size=micro,
                                        gradient_accumulation_steps=choice.accumulation,
                                        gradient_checkpointing_layers_per_checkpoint=every)  # fmt: skip
        try:
            ds = with_zero(ds_config, choice, hardware.gpus_per_node, hardware.nodes)
            plan = make_plan(candidate, hardware, ds, vocab_size=vocab_size)
        except ConfigError:
            continue
        if plan.fits and plan.expected_tokens_per_s:
            ranked.append((choice, plan))
    ranked.sort(key=lambda pair: -pair[1].expected_tokens_per_s)
    shipped = shipped_choice(config, ds_config)
    rank = next((i + 1 for i, (choice, _) in enumerate(ranked) if choice == shipped), None)
    return ranked, shipped, rank


def format_search(ranked, shipped: Choice, rank: int | None, hardware, top: int = 5) -> str:
    lines = [f"configurations that fit on {hardware.gpus} {hardware.devices} / {hardware.nodes} node(s), by modelled "
             "tokens/s "
             f"({len(ranked)} fit):"]  # fmt: skip
    for index, (choice, plan) in enumerate(ranked[:top], start=1):
        lines.append(
            f"  {index}. {plan.expected_tokens_per_s:>9,.0f} tokens/s  MFU {plan.predicted_mfu:5.1%}  "
            f"{plan.per_gpu_memory_gb['total']:5.1f} GB/GPU  {plan.host_memory_per_node_gb:6,.0f} GB host/node  "
            f"{plan.bound}-bound  {choice.label()}"
        )
    where = f"rank {rank} of {len(ranked)}" if rank else "does not fit"
    lines.append(f"  the shipped recipe ({shipped.label()}): {where}")
    if rank:
        plan = ranked[rank - 1][1]
        lines.append(f"     {plan.expected_tokens_per_s:,.0f} tokens/s, {plan.per_gpu_memory_gb['total']:.1f} GB/GPU")
    return "\n".join(lines)

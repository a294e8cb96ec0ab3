"""Plan before you spend: memory, time and cost of a recipe on given hardware.

    python -m recipes.plan --config recipes/configs/llama70b_a800x8.yaml [--gpus 8] [--nodes 1]
        [--gpu-memory-gb 80] [--host-memory-gb 1536] [--peak-tflops 312] [--mfu 0.45] [--json] [--key value ...]

Hardware defaults come from the recipe's `hardware` block; recipe keys are overridden as in
pretrain.py (`--total_tokens 2e12`). Pure arithmetic: nothing is allocated, so a 70B plan prints
in well under a second, and `recipes/pretrain.py` runs the same plan as its preflight.

Sources of the terms: ZeRO-3 model states as DeepSpeed's `estimate_zero3_model_states_mem_needs`
counts them; activations per Korthikanti et al. 2022 (34·s·b·h bytes per layer in 16-bit with a
fused attention kernel, no s² term); FLOPs per token 6N + 12·L·s·h (PaLM, appendix B).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recipes.config import (
    MODEL_CONFIG_KEYS,
    ConfigError,
    PretrainConfig,
    load_config,
    validate_for_world,
    warmup_fraction,
)
from recipes.deepspeed_config import load_deepspeed_json, offloads

GB = 1e9
DEFAULT_DEEPSPEED_JSON = Path(__file__).resolve().parent.parent / "accelerate_configs" / "deepspeed" / "zero3.json"
ASSUMED_VOCAB_SIZE = 32_000  # Llama-2's, when neither model_config nor a local tokenizer says
ACTIVATION_BYTES_PER_SBH = 34  # per layer, 16-bit, fused attention (Korthikanti et al. 2022, table 2)
LOGIT_BYTES_PER_ELEMENT = 12  # bf16 logits + their fp32 upcast for the loss + fp32 and bf16 gradients
CUDA_CONTEXT_GB = 1.5  # CUDA context, NCCL buffers and kernels' workspaces, per GPU
ALLOCATOR_MARGIN = 0.05  # fragmentation of the caching allocator, on top of everything else
HOST_OVERHEAD_PER_RANK_GB = 4.0  # Python, torch, CUDA host allocations of one training process
HOST_PER_DATALOADER_WORKER_GB = 0.5  # a worker process with its tokenizer and prefetched rows
DEEPSPEED_HOST_BUFFER_FACTOR = 1.5  # DeepSpeed's own estimator multiplies host needs by this
# sha256 of checkpoint files at resume, per rank (hashlib with SHA-NI, files in page cache, on the 2-core development
# machine: 1.14-1.22 GB/s with the machine idle, 0.80-0.84 GB/s with both cores busy; the lower figure, since every
# rank of a node hashes at once). Storage that reads slower per rank bounds it instead.
SHA256_GB_PER_S = 0.8
# Checkpoint write rate per rank to shared storage (an assumption: a parallel filesystem at ~8 GB/s per 8-GPU node;
# override by reading the save time logged by a smoke run). A save writes, then hashes what it wrote.
CHECKPOINT_WRITE_GB_PER_S_PER_RANK = 1.0


@dataclass
class Hardware:
    gpus: int
    nodes: int
    gpu_memory_gb: float | None
    host_memory_gb: float | None
    peak_tflops: float | None
    mfu: float

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes


@dataclass
class Plan:
    params: int
    largest_layer_params: int
    num_layers: int
    total_steps: int
    warmup_fraction: float
    flops_per_token: float
    hardware_flops_per_token: float
    per_gpu_memory_gb: dict[str, float]
    model_states_gpu_gb: float
    host_memory_per_node_gb: float
    host_memory_terms_gb: dict[str, float]
    deepspeed_host_estimate_gb: float
    peak_tokens_per_s: float | None
    expected_tokens_per_s: float | None
    step_time_s: float | None
    expected_days: float | None
    gpu_hours: float | None
    checkpoint_gb: float
    checkpoint_disk_gb: float
    checkpoint_verify_s: float
    checkpoint_save_s: float
    fits: bool
    verdicts: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    hardware: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def llama_parameter_count(
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int | None = None,
    tie_word_embeddings: bool = False,
    **_: Any,
) -> tuple[int, int]:
    """(all parameters, largest single module's parameters) of a Llama model without biases."""
    kv_heads = num_key_value_heads or num_attention_heads
    head_dim = hidden_size // num_attention_heads
    attention = 2 * hidden_size * hidden_size + 2 * hidden_size * kv_heads * head_dim
    mlp = 3 * hidden_size * intermediate_size
    per_layer = attention + mlp + 2 * hidden_size  # two RMSNorm weights
    embeddings = vocab_size * hidden_size * (1 if tie_word_embeddings else 2)
    total = embeddings + num_hidden_layers * per_layer + hidden_size
    largest = max(vocab_size * hidden_size, hidden_size * intermediate_size)
    return total, largest


def resolve_vocab_size(config: PretrainConfig, warnings: list[str]) -> int:
    if "vocab_size" in config.model_config:
        return int(config.model_config["vocab_size"])
    tokenizer_dir = Path(config.tokenizer_name_or_path)
    if tokenizer_dir.is_dir():
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(tokenizer_dir))
    warnings.append(
        f"vocabulary size assumed {ASSUMED_VOCAB_SIZE:,} (tokenizer {config.tokenizer_name_or_path} is not here); "
        "set model_config.vocab_size to plan exactly"
    )
    return ASSUMED_VOCAB_SIZE


def model_shape(config: PretrainConfig, warnings: list[str]) -> dict[str, Any]:
    """The Llama shape: `model_config`, or the config.json of a local `model_name_or_path`."""
    if not config.model_name_or_path:
        return dict(config.model_config)
    from transformers import AutoConfig

    try:
        loaded = AutoConfig.from_pretrained(config.model_name_or_path)
    except OSError as error:
        raise ConfigError(f"model_name_or_path {config.model_name_or_path}: cannot read its config ({error})") from None
    return {k: getattr(loaded, k) for k in MODEL_CONFIG_KEYS if getattr(loaded, k, None) is not None}


def hardware_from(config: PretrainConfig, **overrides) -> Hardware:
    block = dict(config.hardware)
    values = {
        "gpus": block.get("gpus", 8),
        "nodes": block.get("nodes", 1),
        "gpu_memory_gb": block.get("gpu_memory_gb", 80),
        "host_memory_gb": block.get("host_memory_gb"),
        "peak_tflops": config.peak_tflops_per_device,
        "mfu": block.get("mfu", 0.45),
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    hardware = Hardware(**values)
    if hardware.gpus % hardware.nodes:
        raise ConfigError(f"--gpus {hardware.gpus} is not divisible by --nodes {hardware.nodes}")
    if not 0 < hardware.mfu <= 1:
        raise ConfigError(f"--mfu {hardware.mfu} must lie in (0, 1]")
    return hardware


def live_hardware(config: PretrainConfig, world_size: int) -> Hardware:
    """The hardware this launch runs on. Without CUDA the recipe's `hardware.gpu_memory_gb` stands in
    for device memory (unset: no device-memory check), so CPU rehearsals can exercise the refusal."""
    import psutil
    import torch

    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if torch.cuda.is_available():
        gpu_memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    else:
        gpu_memory_gb = config.hardware.get("gpu_memory_gb")
    return hardware_from(
        config,
        gpus=world_size,
        nodes=max(1, world_size // gpus_per_node),
        gpu_memory_gb=gpu_memory_gb,
        host_memory_gb=psutil.virtual_memory().total / 1e9,
    )


def training_flops_per_token(num_params: int, num_layers: int, seq_len: int, hidden_size: int) -> float:
    """6N for the matmuls forward and backward plus 12·L·s·h for attention scores (PaLM appendix B).

    Recomputation is not counted: MFU measures useful work, not work done twice."""
    return 6.0 * num_params + 12.0 * num_layers * seq_len * hidden_size


def gpu_memory_terms(config: PretrainConfig, shape: dict[str, Any], params: int, largest: int, world: int,
                     ds_config: dict[str, Any]) -> tuple[dict[str, float], float]:  # fmt: skip
    """Per-GPU memory by term in GB, and DeepSpeed's model states (the first four terms; tests compare them)."""
    zero = ds_config.get("zero_optimization", {})
    offload_optimizer, offload_param = offloads(ds_config, "optimizer"), offloads(ds_config, "param")
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    micro, seq = config.per_device_train_batch_size, config.max_seq_length
    memory: dict[str, float] = {}
    memory["bf16_parameter_shard"] = 0.0 if offload_param else 2 * params / world / GB
    memory["optimizer_states"] = 0.0 if offload_optimizer else 12 * params / world / GB
    memory["fp32_gradient_partition"] = 0.0 if offload_optimizer else 4 * params / world / GB
    memory["largest_layer_gathered"] = 4 * largest / GB
    model_states_gpu = sum(memory.values())
    # The bf16 gradient shard is counted on the GPU as the SPEC does (conservative under offload,
    # where DeepSpeed moves reduced partitions to host memory as they complete).
    memory["bf16_gradient_shard"] = 2 * params / world / GB
    # What ZeRO-3 allocates for its knobs, in 16-bit elements (DeepSpeed's defaults where the JSON is silent): the
    # reduce-scatter bucket, parameters fetched ahead, and the bound on gathered parameters alive at once.
    memory["reduce_bucket"] = 2 * float(zero.get("reduce_bucket_size", 5e8)) / GB
    memory["prefetch_bucket"] = 2 * float(zero.get("stage3_prefetch_bucket_size", 5e7)) / GB
    memory["live_parameters"] = 2 * min(float(zero.get("stage3_max_live_parameters", 1e9)), params) / GB
    per_layer_activations = ACTIVATION_BYTES_PER_SBH * seq * micro * hidden
    if config.gradient_checkpointing:
        per_checkpoint = config.gradient_checkpointing_layers_per_checkpoint
        stored = math.ceil(layers / per_checkpoint) * 2 * seq * micro * hidden
        memory["activations"] = (stored + per_checkpoint * per_layer_activations) / GB
    else:
        memory["activations"] = layers * per_layer_activations / GB
    memory["logits"] = LOGIT_BYTES_PER_ELEMENT * micro * seq * shape["vocab_size"] / GB
    memory["cuda_context"] = CUDA_CONTEXT_GB
    memory["allocator_margin"] = ALLOCATOR_MARGIN * sum(memory.values())
    memory = {k: round(v, 3) for k, v in memory.items()}
    memory["total"] = round(sum(memory.values()), 3)
    return memory, model_states_gpu


def host_memory_terms(config: PretrainConfig, params: int, hardware: Hardware, ds_config: dict[str, Any]):
    """Host memory per node by term in GB: fp32 master weights, Adam moments and fp32 gradients when offloaded."""
    nodes, per_node = hardware.nodes, hardware.gpus_per_node
    host: dict[str, float] = {}
    host["offloaded_optimizer"] = (16 * params / nodes / GB) if offloads(ds_config, "optimizer") else 0.0
    host["offloaded_parameters"] = (2 * params / nodes / GB) if offloads(ds_config, "param") else 0.0
    host["training_processes"] = HOST_OVERHEAD_PER_RANK_GB * per_node
    host["dataloader_workers"] = HOST_PER_DATALOADER_WORKER_GB * config.dataloader_num_workers * per_node
    return {k: round(v, 3) for k, v in host.items()}


def time_terms(config: PretrainConfig, hardware: Hardware, flops_per_token: float) -> tuple:
    """(ceiling tokens/s, expected tokens/s, step seconds, days, GPU-hours); all None without a peak. MFU counts
    useful FLOPs only: recomputation is extra hardware work (one more forward)."""
    if not hardware.peak_tflops:
        return None, None, None, None, None
    world, rows = hardware.gpus, config.resolved_global_batch_size(hardware.gpus)
    tokens = config.total_steps(world) * rows * config.max_seq_length
    peak = world * hardware.peak_tflops * 1e12 / flops_per_token
    expected = peak * hardware.mfu
    days = tokens / expected / 86_400
    return peak, expected, rows * config.max_seq_length / expected, days, days * 24 * world


def make_plan(
    config: PretrainConfig,
    hardware: Hardware,
    ds_config: dict[str, Any],
    *,
    vocab_size: int | None = None,
    target_tokens_per_s: float | None = None,
) -> Plan:
    """The whole plan; every number derives from the recipe, the DeepSpeed config and the hardware."""
    validate_for_world(config, hardware.gpus)
    warnings: list[str] = []
    shape = model_shape(config, warnings)
    if vocab_size:
        shape["vocab_size"] = vocab_size
    elif "vocab_size" not in shape:
        shape["vocab_size"] = resolve_vocab_size(config, warnings)
    params, largest = llama_parameter_count(**shape)
    world, seq = hardware.gpus, config.max_seq_length
    memory, model_states_gpu = gpu_memory_terms(config, shape, params, largest, world, ds_config)
    host = host_memory_terms(config, params, hardware, ds_config)
    deepspeed_host = (host["offloaded_optimizer"] + host["offloaded_parameters"]) * DEEPSPEED_HOST_BUFFER_FACTOR

    flops = training_flops_per_token(params, shape["num_hidden_layers"], seq, shape["hidden_size"])
    total_steps = config.total_steps(world)
    peak, expected, step_time, days, gpu_hours = time_terms(config, hardware, flops)

    checkpoint_gb = (2 * params + 12 * params) / GB  # bf16 weights + fp32 master and Adam moments
    verify_s = checkpoint_gb / (world * SHA256_GB_PER_S)  # every rank hashes its share
    keep = (config.save_total_limit or 1) + 1  # the new checkpoint is complete before the oldest goes
    plan = Plan(
        params=params,
        largest_layer_params=largest,
        num_layers=shape["num_hidden_layers"],
        total_steps=total_steps,
        warmup_fraction=warmup_fraction(config, world),
        flops_per_token=flops,
        hardware_flops_per_token=flops * (4 / 3 if config.gradient_checkpointing else 1.0),
        per_gpu_memory_gb=memory,
        model_states_gpu_gb=round(model_states_gpu, 3),
        host_memory_per_node_gb=round(sum(host.values()), 3),
        host_memory_terms_gb=host,
        deepspeed_host_estimate_gb=round(deepspeed_host, 3),
        peak_tokens_per_s=peak,
        expected_tokens_per_s=expected,
        step_time_s=step_time,
        expected_days=days,
        gpu_hours=gpu_hours,
        checkpoint_gb=round(checkpoint_gb, 1),
        checkpoint_disk_gb=round(checkpoint_gb * keep, 1),
        checkpoint_verify_s=round(verify_s, 1),
        checkpoint_save_s=round(
            checkpoint_gb / world * (1 / CHECKPOINT_WRITE_GB_PER_S_PER_RANK + 1 / SHA256_GB_PER_S), 1
        ),
        fits=True,
        warnings=warnings,
        hardware=asdict(hardware),
    )
    _judge(plan, config, hardware, target_tokens_per_s)
    return plan


def _judge(plan: Plan, config: PretrainConfig, hardware: Hardware, target_tokens_per_s: float | None) -> None:
    memory = plan.per_gpu_memory_gb
    if hardware.gpu_memory_gb is not None and memory["total"] > hardware.gpu_memory_gb:
        plan.fits = False
        terms = sorted(((v, k) for k, v in memory.items() if k != "total"), reverse=True)[:3]
        biggest = ", ".join(f"{k} {v:.1f} GB" for v, k in terms)
        plan.verdicts.append(
            f"does not fit: {memory['total']:.1f} GB per GPU needed, {hardware.gpu_memory_gb:g} GB available; "
            f"largest terms: {biggest}"
        )
    if hardware.host_memory_gb is not None and plan.host_memory_per_node_gb > hardware.host_memory_gb:
        plan.fits = False
        plan.verdicts.append(
            f"does not fit: {plan.host_memory_per_node_gb:.0f} GB of host memory per node needed, "
            f"{hardware.host_memory_gb:g} GB available (offloaded optimizer "
            f"{plan.host_memory_terms_gb['offloaded_optimizer']:.0f} GB)"
        )
    if plan.fits:
        plan.verdicts.append(
            f"fits: {memory['total']:.1f} GB per GPU"
            + (f" of {hardware.gpu_memory_gb:g}" if hardware.gpu_memory_gb else "")
            + f", {plan.host_memory_per_node_gb:.0f} GB host memory per node"
            + (f" of {hardware.host_memory_gb:g}" if hardware.host_memory_gb else "")
        )
    if hardware.host_memory_gb is not None and plan.deepspeed_host_estimate_gb > hardware.host_memory_gb:
        plan.warnings.append(
            f"DeepSpeed's estimator, with its {DEEPSPEED_HOST_BUFFER_FACTOR}x buffer factor, asks "
            f"{plan.deepspeed_host_estimate_gb:.0f} GB of host memory per node, more than the "
            f"{hardware.host_memory_gb:g} GB available: little headroom for pinned buffers"
        )
    if plan.peak_tokens_per_s and target_tokens_per_s and target_tokens_per_s > plan.peak_tokens_per_s:
        plan.warnings.append(
            f"the target of {target_tokens_per_s:,.0f} tokens/s is {target_tokens_per_s / plan.peak_tokens_per_s:.1f}x "
            f"the physical ceiling of {plan.peak_tokens_per_s:,.0f} tokens/s at 100% MFU"
        )
    if hardware.mfu > 0.6:
        plan.warnings.append(f"MFU {hardware.mfu:.0%} is above what published large runs reach (45-55%)")
    if not 0.001 <= plan.warmup_fraction <= 0.1:
        plan.warnings.append(
            f"warmup is {plan.warmup_fraction:.2%} of training ({config.warmup_steps:,} of {plan.total_steps:,} "
            "steps); 0.1-10% is usual"
        )
    if plan.params > 1e9 and not config.gradient_checkpointing:
        plan.warnings.append("gradient checkpointing is off for a >1B model: activations dominate memory")
    if plan.expected_days and plan.expected_days > 365:
        plan.warnings.append(
            f"the token budget takes {plan.expected_days / 365:.1f} years at {hardware.mfu:.0%} MFU on "
            f"{hardware.gpus} GPUs"
        )


def format_plan(plan: Plan, config: PretrainConfig) -> str:
    h = plan.hardware
    size = f"{plan.params / 1e9:.2f}B" if plan.params >= 1e9 else f"{plan.params / 1e6:.2f}M"
    lines = [
        f"plan for a {plan.num_layers}-layer Llama, {size} parameters, on {h['gpus']} GPUs / {h['nodes']} node(s)",
        f"  steps: {plan.total_steps:,}; warmup {config.warmup_steps:,} steps = {plan.warmup_fraction:.2%}",
        f"  FLOPs per token: {plan.flops_per_token / 1e9:.0f} G "
        f"({plan.hardware_flops_per_token / 1e9:.0f} G with recomputation)",
    ]
    if plan.peak_tokens_per_s:
        lines += [
            f"  tokens/s: ceiling {plan.peak_tokens_per_s:,.0f} at 100% MFU; expected "
            f"{plan.expected_tokens_per_s:,.0f} at {h['mfu']:.0%} ({plan.expected_tokens_per_s / h['gpus']:,.0f}/GPU)",
            f"  step time: {plan.step_time_s:.1f} s; total: {plan.expected_days:,.0f} days "
            f"({plan.expected_days / 365:.1f} years), {plan.gpu_hours / 1e6:.2f}M GPU-hours",
        ]
    lines.append("  GPU memory per GPU (GB):")
    lines += [f"    {name:28s} {value:8.2f}" for name, value in plan.per_gpu_memory_gb.items()]
    lines.append(f"    (DeepSpeed model states: {plan.model_states_gpu_gb:.2f})")
    lines.append(f"  host memory per node: {plan.host_memory_per_node_gb:,.0f} GB")
    lines += [f"    {name:28s} {value:8.1f}" for name, value in plan.host_memory_terms_gb.items()]
    lines.append(
        f"  checkpoint: {plan.checkpoint_gb:,.0f} GB each; {plan.checkpoint_disk_gb:,.0f} GB of disk for "
        f"save_total_limit={config.save_total_limit} plus the one being written; verified at resume in "
        f"~{plan.checkpoint_verify_s:,.0f} s (sha256, every rank its share at {SHA256_GB_PER_S} GB/s); a save takes "
        f"~{plan.checkpoint_save_s:,.0f} s (write at {CHECKPOINT_WRITE_GB_PER_S_PER_RANK} GB/s per rank, then hash)"
    )
    lines += [f"  verdict: {v}" for v in plan.verdicts]
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


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
        "expected_days": plan.expected_days,
        "gpu_hours": plan.gpu_hours,
        "checkpoint_gb": plan.checkpoint_gb,
        "fits": plan.fits,
        "warnings": plan.warnings,
        **{k: v for k, v in full.items() if k not in ("warnings",)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int)
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--gpu-memory-gb", type=float)
    parser.add_argument("--host-memory-gb", type=float)
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--mfu", type=float)
    parser.add_argument("--target-tokens-per-s", type=float, help="a throughput someone promised, to check")
    parser.add_argument("--deepspeed-config", default=str(DEFAULT_DEEPSPEED_JSON))
    parser.add_argument("--json", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    try:
        config = load_config(args.config, overrides)
        hardware = hardware_from(
            config,
            gpus=args.gpus,
            nodes=args.nodes,
            gpu_memory_gb=args.gpu_memory_gb,
            host_memory_gb=args.host_memory_gb,
            peak_tflops=args.peak_tflops,
            mfu=args.mfu,
        )
        plan = make_plan(
            config, hardware, load_deepspeed_json(args.deepspeed_config), target_tokens_per_s=args.target_tokens_per_s
        )
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(json_summary(plan)) if args.json else format_plan(plan, config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

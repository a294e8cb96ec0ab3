"""Plan before you spend: memory, time and cost of a recipe on given hardware.

    python -m recipes.plan --config recipes/configs/llama70b_a800x8.yaml [--gpus 8] [--nodes 1]
        [--gpu-memory-gb 80] [--host-memory-gb 1536] [--peak-tflops 312] [--profile a800-pcie]
        [--interconnect ib200] [--intra-node-gb-s 20] [--inter-node-gbps 200] [--host-link-gb-s 20]
        [--host-memory-gb-s 200] [--compute-efficiency 0.6] [--overlap 0.3] [--mfu 0.45]
        [--search] [--days N] [--json] [--key value ...]

Hardware defaults come from the recipe's `hardware` block; recipe keys are overridden as in
pretrain.py (`--total_tokens 2e12`). Pure arithmetic: nothing is allocated, so a 70B plan prints
in well under a second, and `recipes/pretrain.py` runs the same plan as its preflight.

Sources of the terms: ZeRO-3 model states as DeepSpeed's `estimate_zero3_model_states_mem_needs`
counts them; activations per Korthikanti et al. 2022 (34·s·b·h bytes per layer in 16-bit with a
fused attention kernel, no s² term); FLOPs per token 6N + 12·L·s·h (PaLM, appendix B). Step time from the
communication model of `recipes.step_time` on the hardware profile's wires; `--mfu` replaces it with a
fixed utilisation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eval.in_loop import SPLITS_REQUESTS_OVER_RANKS
from recipes.config import (
    MODEL_CONFIG_KEYS,
    ConfigError,
    PretrainConfig,
    load_config,
    validate_for_world,
    warmup_fraction,
)
from recipes.deepspeed_config import load_deepspeed_json, offloads
from recipes.eval_cost import MMLU_SUBJECTS, SHARE_WARNING, EvalCost, EvalWork, eval_cost
from recipes.step_time import (
    GPU_PROFILES,
    INTERCONNECT_EFFICIENCY,
    StepTime,
    Workload,
    Zero3,
    chinchilla,
    collective_s,
    host_s_per_pass,
    step_time,
    wires_from,
)

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


DEFAULT_MFU = 0.45  # without a hardware profile: the utilisation published large runs reach

WIRE_KEYS = ("intra_node_gb_s", "inter_node_gbps", "host_link_gb_s", "host_memory_gb_s", "compute_efficiency",
             "overlap")  # fmt: skip


@dataclass
class Hardware:
    gpus: int
    nodes: int
    gpu_memory_gb: float | None
    host_memory_gb: float | None
    peak_tflops: float | None
    mfu: float | None  # a fixed utilisation, in place of the communication model
    profile: str | None = None  # recipes.step_time.GPU_PROFILES
    interconnect: str | None = None  # ib100, ib200, ib400, ib800 (between nodes)
    wires: dict = field(default_factory=dict)  # overrides of the profiles' numbers (WIRE_KEYS)

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    def step_model(self):
        """The profile's wires with this hardware's overrides; None without a profile."""
        if not self.profile:
            return None
        overrides = dict(self.wires)
        if overrides.get("inter_node_gbps"):
            overrides["inter_node_gb_s"] = overrides.pop("inter_node_gbps") / 8 * INTERCONNECT_EFFICIENCY
        overrides.pop("inter_node_gbps", None)
        wires = wires_from(self.profile, self.interconnect, peak_tflops=self.peak_tflops, **overrides)
        if self.nodes > 1 and wires.inter_node_gb_s is None:
            raise ConfigError(f"{self.nodes} nodes need an interconnect (hardware.interconnect, --interconnect "
                              "ib100|ib200|ib400|ib800, or --inter-node-gbps)")  # fmt: skip
        return wires


@dataclass
class Plan:
    params: int
    largest_layer_params: int
    num_layers: int
    vocab_size: int
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
    step_time_breakdown_s: dict[str, float] | None  # per micro-batch: compute, communication,
    # exposed_communication; per step: optimizer (CPU Adam and the upload of the updated parameters)
    predicted_mfu: float | None
    bound: str | None  # "compute" or "communication", per micro-batch
    modelled_step_s: float | None
    accumulation: int
    wires: dict[str, float]
    expected_days: float | None
    gpu_hours: float | None
    checkpoint_gb: float
    checkpoint_disk_gb: float
    checkpoint_verify_s: float
    checkpoint_save_s: float
    eval_documents: dict[str, int] | None  # in-loop benchmarks: documents per evaluation, per task
    eval_forward_passes: int | None  # per rank and evaluation, each one gathering the whole model
    eval_seconds: float | None
    eval_seconds_by_task: dict[str, float] | None
    eval_share: float | None  # of the training time between two benchmark evaluations
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
    """The recipe's `hardware` block with command-line overrides (None: not given). Wire numbers (WIRE_KEYS) may
    come in either."""
    block = dict(config.hardware)
    values = {
        "gpus": block.get("gpus", 8),
        "nodes": block.get("nodes", 1),
        "gpu_memory_gb": block.get("gpu_memory_gb", 80),
        "host_memory_gb": block.get("host_memory_gb"),
        "peak_tflops": config.peak_tflops_per_device,
        "mfu": block.get("mfu"),
        "profile": block.get("profile"),
        "interconnect": block.get("interconnect"),
    }
    wires = {key: block[key] for key in WIRE_KEYS if block.get(key) is not None}
    wires.update({key: overrides.pop(key) for key in WIRE_KEYS if overrides.get(key) is not None})
    values.update({k: v for k, v in overrides.items() if v is not None and k not in WIRE_KEYS})
    hardware = Hardware(**values, wires=wires)
    if hardware.profile and hardware.profile not in GPU_PROFILES:
        raise ConfigError(f"hardware profile {hardware.profile!r} is not one of {', '.join(sorted(GPU_PROFILES))}")
    if hardware.peak_tflops is None and hardware.profile:
        hardware.peak_tflops = GPU_PROFILES[hardware.profile].peak_tflops
    if hardware.mfu is None and not hardware.profile:
        hardware.mfu = DEFAULT_MFU
    if hardware.gpus % hardware.nodes:
        raise ConfigError(f"--gpus {hardware.gpus} is not divisible by --nodes {hardware.nodes}")
    if hardware.mfu is not None and not 0 < hardware.mfu <= 1:
        raise ConfigError(f"--mfu {hardware.mfu} must lie in (0, 1]")
    for key, value in wires.items():
        low_ok = value >= 0 if key == "overlap" else value > 0
        if not low_ok or (key in ("compute_efficiency", "overlap") and value > 1):
            valid = "in [0, 1]" if key == "overlap" else "in (0, 1]" if key == "compute_efficiency" else "positive"
            raise ConfigError(f"--{key.replace('_', '-')} {value}: must be {valid}")
    try:
        hardware.step_model()
    except ValueError as error:
        raise ConfigError(str(error)) from None
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
    hpz = int(zero.get("zero_hpz_partition_size", 1))
    if hpz > 1:  # ZeRO++: a second bf16 copy of the parameters, partitioned over the node's GPUs only
        memory["hpz_secondary_partition"] = 2 * params / hpz / GB
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


def module_sizes(shape: dict[str, Any]) -> list[tuple[int, int]]:
    """(how many, parameters each) of every module with weights in a Llama: what ZeRO-3 partitions and gathers."""
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads = shape["num_attention_heads"]
    kv_dim = (shape.get("num_key_value_heads") or heads) * (hidden // heads)
    embeddings = [(1 if shape.get("tie_word_embeddings") else 2, shape["vocab_size"] * hidden)]
    per_layer = [(2, hidden * hidden), (2, hidden * kv_dim), (3, hidden * shape["intermediate_size"]), (2, hidden)]
    return [*embeddings, *((count * layers, size) for count, size in per_layer), (1, hidden)]


def predicted_step(config: PretrainConfig, hardware: Hardware, ds_config: dict[str, Any], shape: dict[str, Any],
                   params: int, flops_per_token: float) -> StepTime | None:  # fmt: skip
    """The communication model's step (None without a hardware profile or a peak)."""
    wires = hardware.step_model()
    if wires is None or not hardware.peak_tflops:
        return None
    zero = Zero3.from_json(ds_config)
    world, micro = hardware.gpus, config.per_device_train_batch_size
    rows = config.resolved_global_batch_size(world)
    sizes = module_sizes(shape)
    layer_params = sum(count * size for count, size in sizes[1:-1]) // shape["num_hidden_layers"]
    recompute = 4 / 3 if config.gradient_checkpointing else 1.0
    work = Workload(
        params=params,
        persistent_params=sum(count * size for count, size in sizes if size < zero.persistence_threshold),
        layer_params=layer_params,
        layers_per_checkpoint=config.gradient_checkpointing_layers_per_checkpoint if config.gradient_checkpointing
        else 0,
        hardware_flops_per_token=flops_per_token * recompute,
        useful_flops_per_token=flops_per_token,
        tokens_per_micro_batch=micro * config.max_seq_length,
        accumulation=rows // (micro * world),
        gpus=world,
        nodes=hardware.nodes,
        hooked_modules=sum(count for count, _ in sizes),
    )  # fmt: skip
    return step_time(work, zero, wires)


def time_terms(config: PretrainConfig, hardware: Hardware, flops_per_token: float, step: StepTime | None) -> tuple:
    """(ceiling tokens/s, expected tokens/s, step seconds, days, GPU-hours); all None without a peak. The expected
    rate is the communication model's step, or the fixed `mfu` when one is given. MFU counts useful FLOPs only:
    recomputation is extra hardware work (one more forward)."""
    if not hardware.peak_tflops or (step is None and hardware.mfu is None):
        return None, None, None, None, None
    world, rows = hardware.gpus, config.resolved_global_batch_size(hardware.gpus)
    tokens = config.total_steps(world) * rows * config.max_seq_length
    peak = world * hardware.peak_tflops * 1e12 / flops_per_token
    expected = peak * hardware.mfu if hardware.mfu is not None else rows * config.max_seq_length / step.step
    days = tokens / expected / 86_400
    return peak, expected, rows * config.max_seq_length / expected, days, days * 24 * world


def _wire_numbers(hardware: Hardware) -> dict[str, float]:
    wires = hardware.step_model()
    if wires is None:
        return {}
    numbers = {"peak TFLOPs": wires.peak_tflops, "intra-node GB/s": wires.intra_node_gb_s,
               "inter-node GB/s": wires.inter_node_gb_s, "host link GB/s": wires.host_link_gb_s,
               "host memory GB/s": wires.host_memory_gb_s, "compute efficiency": wires.compute_efficiency,
               "overlap": wires.overlap}  # fmt: skip
    return {key: round(value, 3) for key, value in numbers.items() if value is not None}


def checkpoint_terms(config: PretrainConfig, params: int, world: int) -> dict[str, float]:
    checkpoint_gb = (2 * params + 12 * params) / GB  # bf16 weights + fp32 master and Adam moments
    keep = (config.save_total_limit or 1) + 1  # the new checkpoint is complete before the oldest goes
    return {
        "checkpoint_gb": round(checkpoint_gb, 1),
        "checkpoint_disk_gb": round(checkpoint_gb * keep, 1),
        "checkpoint_verify_s": round(checkpoint_gb / (world * SHA256_GB_PER_S), 1),  # every rank hashes its share
        "checkpoint_save_s": round(
            checkpoint_gb / world * (1 / CHECKPOINT_WRITE_GB_PER_S_PER_RANK + 1 / SHA256_GB_PER_S), 1
        ),
    }


def local_mmlu_subjects(mmlu_dir: str | None) -> int:
    """Subjects in a local MMLU directory that is here; all 57 otherwise (the hub, or a cluster path)."""
    if not mmlu_dir or not Path(mmlu_dir).is_dir():
        return MMLU_SUBJECTS
    from data_prep.benchmark_files import BenchmarkDataError, mmlu_layout

    try:
        return len(mmlu_layout(mmlu_dir)[1])
    except BenchmarkDataError:  # a malformed directory is preflight's to report
        return MMLU_SUBJECTS


def price_evaluation(config: PretrainConfig, hardware: Hardware, ds_config: dict[str, Any], shape: dict[str, Any],
                     params: int, step_seconds: float | None) -> EvalCost | None:  # fmt: skip
    """The in-loop benchmarks' cost per evaluation (None without benchmarks or without a peak to price compute)."""
    if not config.eval_tasks or not hardware.peak_tflops:
        return None
    wires = hardware.step_model()
    if wires is not None:
        zero = Zero3.from_json(ds_config)
        persistent = sum(count * size for count, size in module_sizes(shape) if size < zero.persistence_threshold)
        gather_s = collective_s(2.0 * (params - persistent), wires, hardware.gpus, hardware.nodes)
        flops_per_s = hardware.peak_tflops * 1e12 * wires.compute_efficiency
    else:  # a fixed MFU and no wires: the gathers are not priced
        gather_s, flops_per_s = 0.0, hardware.peak_tflops * 1e12 * (hardware.mfu or DEFAULT_MFU)
    work = EvalWork(
        tasks=tuple(config.eval_tasks),
        limit=config.eval_limit,
        num_fewshot=config.eval_num_fewshot,
        batch_size=config.per_device_eval_batch_size,
        max_gen_toks=config.eval_max_gen_toks,
        ranks_sharing=hardware.gpus if SPLITS_REQUESTS_OVER_RANKS else 1,
        mmlu_subjects=local_mmlu_subjects(config.mmlu_dir),
    )
    between = step_seconds * config.eval_steps * config.eval_benchmarks_every if step_seconds else None
    host_s = host_s_per_pass(sum(count for count, _ in module_sizes(shape)))
    return eval_cost(work, params=params, gather_s=gather_s, flops_per_s=flops_per_s, host_s_per_forward=host_s,
                     training_s_between=between)  # fmt: skip


def eval_terms(evaluation: EvalCost | None) -> dict[str, Any]:
    """The plan's `eval_*` fields (all None without benchmarks to price)."""
    if evaluation is None:
        return dict.fromkeys(("eval_documents", "eval_forward_passes", "eval_seconds", "eval_seconds_by_task",
                              "eval_share"))  # fmt: skip
    return {"eval_documents": evaluation.documents, "eval_forward_passes": evaluation.forward_passes,
            "eval_seconds": evaluation.seconds, "eval_seconds_by_task": evaluation.seconds_by_task,
            "eval_share": evaluation.share}  # fmt: skip


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
    modelled = predicted_step(config, hardware, ds_config, shape, params, flops)
    peak, expected, step_seconds, days, gpu_hours = time_terms(config, hardware, flops, modelled)

    plan = Plan(
        params=params,
        largest_layer_params=largest,
        num_layers=shape["num_hidden_layers"],
        vocab_size=shape["vocab_size"],
        total_steps=config.total_steps(world),
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
        step_time_s=step_seconds,
        step_time_breakdown_s=modelled.breakdown() if modelled else None,
        predicted_mfu=modelled.predicted_mfu if modelled else None,
        bound=modelled.bound if modelled else None,
        modelled_step_s=modelled.step if modelled else None,
        accumulation=config.resolved_global_batch_size(world) // (config.per_device_train_batch_size * world),
        wires=_wire_numbers(hardware),
        expected_days=days,
        gpu_hours=gpu_hours,
        **checkpoint_terms(config, params, world),
        **eval_terms(price_evaluation(config, hardware, ds_config, shape, params, step_seconds)),
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
    if hardware.mfu is not None and hardware.mfu > 0.6:
        plan.warnings.append(f"MFU {hardware.mfu:.0%} is above what published large runs reach (45-55%)")
    if not 0.001 <= plan.warmup_fraction <= 0.1:
        plan.warnings.append(
            f"warmup is {plan.warmup_fraction:.2%} of training ({config.warmup_steps:,} of {plan.total_steps:,} "
            "steps); 0.1-10% is usual"
        )
    if plan.eval_share is not None and plan.eval_share > SHARE_WARNING:
        plan.warnings.append(
            f"benchmarks take {plan.eval_share:.0%} of the training time between evaluations "
            f"({plan.eval_seconds / 3600:,.1f} h per evaluation, {plan.eval_forward_passes:,} forward passes per rank, "
            f"each gathering the whole model): set eval_limit, raise per_device_eval_batch_size, lower "
            "eval_max_gen_toks or evaluate less often (eval_benchmarks_every)"
        )
    if plan.params > 1e9 and not config.gradient_checkpointing:
        plan.warnings.append("gradient checkpointing is off for a >1B model: activations dominate memory")
    if plan.expected_days and plan.expected_days > 365:
        plan.warnings.append(
            f"the token budget takes {plan.expected_days / 365:.1f} years at "
            f"{hardware.mfu if hardware.mfu is not None else plan.predicted_mfu:.0%} MFU on {hardware.gpus} GPUs"
        )


def plan_predictions(plan: Plan) -> dict[str, float | None]:
    """What a run measures too, under the names its metrics use (recipes.metrics.plan_vs_measured)."""
    return {
        "step_time_s": plan.step_time_s,
        "tokens_per_s": plan.expected_tokens_per_s,
        "peak_gpu_memory_gb": plan.per_gpu_memory_gb["total"],
        "peak_host_memory_gb_per_node": plan.host_memory_per_node_gb,
    }


def format_plan(plan: Plan, config: PretrainConfig) -> str:
    h = plan.hardware
    size = f"{plan.params / 1e9:.2f}B" if plan.params >= 1e9 else f"{plan.params / 1e6:.2f}M"
    lines = [
        f"plan for a {plan.num_layers}-layer Llama, {size} parameters, on {h['gpus']} GPUs / {h['nodes']} node(s)",
        f"  steps: {plan.total_steps:,}; warmup {config.warmup_steps:,} steps = {plan.warmup_fraction:.2%}",
        f"  FLOPs per token: {plan.flops_per_token / 1e9:.0f} G "
        f"({plan.hardware_flops_per_token / 1e9:.0f} G with recomputation)",
    ]
    if plan.step_time_breakdown_s:
        lines += format_breakdown(plan)
    if plan.peak_tokens_per_s:
        at = f"{h['mfu']:.0%} MFU (--mfu)" if h["mfu"] is not None else f"the modelled {plan.predicted_mfu:.1%} MFU"
        lines += [
            f"  tokens/s: ceiling {plan.peak_tokens_per_s:,.0f} at 100% MFU; expected "
            f"{plan.expected_tokens_per_s:,.0f} at {at} ({plan.expected_tokens_per_s / h['gpus']:,.0f}/GPU)",
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
    if plan.eval_seconds is not None:
        documents = ", ".join(f"{task} {count:,}" for task, count in plan.eval_documents.items())
        share = f", {plan.eval_share:.1%} of the training between evaluations" if plan.eval_share is not None else ""
        lines.append(
            f"  benchmarks per evaluation: {documents} documents; {plan.eval_forward_passes:,} forward passes per "
            f"rank (each gathers the model); ~{format_duration(plan.eval_seconds)}{share}"
        )
    lines += [f"  verdict: {v}" for v in plan.verdicts]
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def format_duration(seconds: float) -> str:
    if seconds >= 86_400:
        return f"{seconds / 86_400:,.1f} days"
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds:,.0f} s"


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


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int)
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--gpu-memory-gb", type=float)
    parser.add_argument("--host-memory-gb", type=float)
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--profile", choices=sorted(GPU_PROFILES), help="GPU and server: bandwidths, peak")
    parser.add_argument("--interconnect", help="between nodes: ib100, ib200, ib400, ib800")
    parser.add_argument("--intra-node-gb-s", type=float, help="collective bandwidth per GPU inside a node")
    parser.add_argument("--inter-node-gbps", type=float, help="network bandwidth per node, Gb/s (line rate)")
    parser.add_argument("--host-link-gb-s", type=float, help="GPU-host bandwidth per GPU")
    parser.add_argument("--host-memory-gb-s", type=float, help="host memory bandwidth per node (CPU Adam)")
    parser.add_argument("--compute-efficiency", type=float, help="fraction of peak the matmuls reach")
    parser.add_argument("--overlap", type=float, help="fraction of the shorter of compute and communication hidden")
    parser.add_argument("--mfu", type=float, help="a fixed utilisation instead of the communication model")
    parser.add_argument("--target-tokens-per-s", type=float, help="a throughput someone promised, to check")
    parser.add_argument("--search", action="store_true", help="rank the configurations that fit by tokens/s")
    parser.add_argument("--days", type=float, help="the tokens reachable in this many days, and the compute-optimal "
                        "model for that compute")  # fmt: skip
    parser.add_argument("--deepspeed-config", default=str(DEFAULT_DEEPSPEED_JSON))
    parser.add_argument("--json", action="store_true")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        config = load_config(args.config, overrides)
        hardware = hardware_from(config, **{key: getattr(args, key) for key in (
            "gpus", "nodes", "gpu_memory_gb", "host_memory_gb", "peak_tflops", "mfu", "profile", "interconnect",
            *WIRE_KEYS)})  # fmt: skip
        ds_config = load_deepspeed_json(args.deepspeed_config)
        plan = make_plan(config, hardware, ds_config, target_tokens_per_s=args.target_tokens_per_s)
        if args.days is not None and (args.days <= 0 or not plan.expected_tokens_per_s):
            raise ConfigError(f"--days {args.days}: needs a positive number of days and a peak (--peak-tflops or "
                              "--profile)")  # fmt: skip
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    days = reachable(plan, args.days) if args.days is not None else None
    if args.search:
        from recipes.plan_search import format_search, search

        ranked, shipped, rank = search(config, hardware, ds_config, vocab_size=plan.vocab_size)
        if args.json:
            print(json.dumps({"ranked": [{"choice": dataclasses.asdict(c), "expected_tokens_per_s":
                                          p.expected_tokens_per_s, "per_gpu_memory_gb": p.per_gpu_memory_gb["total"],
                                          "host_memory_per_node_gb": p.host_memory_per_node_gb}
                                         for c, p in ranked], "shipped_rank": rank}))  # fmt: skip
        else:
            print(format_search(ranked, shipped, rank, hardware))
        return 0
    if args.json:
        print(json.dumps({**json_summary(plan), **(days or {})}))
    else:
        print(format_plan(plan, config) + ("\n" + format_reachable(days, plan) if days else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

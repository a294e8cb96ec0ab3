"""Memory per GPU and per node, and checkpoint size and times, term by term."""

from __future__ import annotations

import math
from typing import Any

from recipes.config import (
    PretrainConfig,
)
from recipes.config.deepspeed import offloads
from recipes.planning.hardware import Hardware
from recipes.planning.step_time import GB

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
    # ZeRO-3 accumulates each rank's reduced gradient partition in one buffer of the model's dtype: on the GPU, or in
    # host memory when the optimizer is offloaded (DeepSpeed's stage3 `grad_partitions_flat_buffer`), where
    # host_memory_terms counts it; the GPU then holds only the reduce bucket below
    memory["bf16_gradient_shard"] = 0.0 if offload_optimizer else 2 * params / world / GB
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
    """Host memory per node by term in GB, as DeepSpeed's ZeRO-3 allocates it with the optimizer offloaded: fp32
    master weights and Adam moments (12 bytes per parameter), and in pinned memory the fp32 gradients (4, one buffer
    per `sub_group_size` elements) and the accumulated gradient partition (2 in bf16), each pinned buffer rounded up
    to a power of two by torch's pinned allocator. A resume maps each rank's optimizer file (recipes.training.
    mapped_load): page cache, not counted; it read the file whole before, 12 bytes per parameter above all this."""
    per_node, world = hardware.gpus_per_node, hardware.gpus
    per_rank = params / world  # each rank's partition, in elements
    zero = ds_config.get("zero_optimization", {})
    host: dict[str, float] = {}
    if offloads(ds_config, "optimizer"):
        pinned = bool(zero.get("offload_optimizer", {}).get("pin_memory", False))
        sub_group = float(zero.get("sub_group_size", 1e9))
        full_groups, rest = divmod(per_rank, sub_group)
        host["offloaded_optimizer"] = 12 * per_rank * per_node / GB
        fp32_gradients = full_groups * pinned_bytes(4 * sub_group, pinned) + pinned_bytes(4 * rest, pinned)
        host["offloaded_fp32_gradients"] = fp32_gradients * per_node / GB
        accumulation = pinned_bytes(gradient_accumulation_bytes(config, ds_config) * per_rank, pinned)
        host["offloaded_gradient_partition"] = accumulation * per_node / GB
    if offloads(ds_config, "param"):
        pinned = bool(zero.get("offload_param", {}).get("pin_memory", False))
        host["offloaded_parameters"] = pinned_bytes(2 * per_rank, pinned) * per_node / GB
    host["training_processes"] = HOST_OVERHEAD_PER_RANK_GB * per_node
    host["dataloader_workers"] = HOST_PER_DATALOADER_WORKER_GB * config.dataloader_num_workers * per_node
    return {k: round(v, 3) for k, v in host.items()}


def pinned_bytes(size: float, pinned: bool) -> float:
    """What a buffer of `size` bytes takes in host memory: pinned, torch's CachingHostAllocator rounds it up to a
    power of two (its default; a 17.2 GB gradient partition takes 34.4 GB)."""
    return float(2 ** math.ceil(math.log2(size))) if pinned and size > 1 else size


def gradient_accumulation_bytes(config: PretrainConfig, ds_config: dict[str, Any]) -> int:
    """Bytes per element of ZeRO-3's gradient partition: DeepSpeed's `data_types.grad_accum_dtype`, else the
    model's dtype."""
    named = str(ds_config.get("data_types", {}).get("grad_accum_dtype") or "").lower()
    if named:
        return 4 if named in ("fp32", "float32", "float") else 2
    return 2 if (config.bf16 or config.fp16) else 4


def deepspeed_host_estimate_gb(params: int, hardware: Hardware, ds_config: dict[str, Any]) -> float:
    """DeepSpeed's own estimator (`estimate_zero3_model_states_mem_needs`) for a node: 16 bytes per parameter
    offloaded with the optimizer and 2 with the parameters, times its 1.5 buffer factor."""
    share = params / hardware.nodes
    offloaded = 16 * offloads(ds_config, "optimizer") + 2 * offloads(ds_config, "param")
    return round(offloaded * share / GB * DEEPSPEED_HOST_BUFFER_FACTOR, 3)


def checkpoint_terms(config: PretrainConfig, params: int, world: int) -> dict[str, float]:
    # fp32 master weights and Adam moments: under ZeRO-3 DeepSpeed's model-states files hold no weights (the
    # parameters are partitions, kB per rank); the bf16 weights are the master's, rounded, and are not saved
    checkpoint_gb = 12 * params / GB
    keep = (config.save_total_limit or 1) + 1  # the new checkpoint is complete before the oldest goes
    return {
        "checkpoint_gb": round(checkpoint_gb, 1),
        "checkpoint_disk_gb": round(checkpoint_gb * keep, 1),
        # an elastic resume converts one checkpoint beside itself: DeepSpeed's ds_to_universal writes its fragments
        # into a tmp/ folder, then the universal copy, and deletes tmp/ (universal/ stays until rotation)
        "conversion_disk_gb": round(2 * checkpoint_gb, 1) if config.elastic else 0.0,
        "checkpoint_verify_s": round(checkpoint_gb / (world * SHA256_GB_PER_S), 1),  # every rank hashes its share
        "checkpoint_save_s": round(
            checkpoint_gb / world * (1 / CHECKPOINT_WRITE_GB_PER_S_PER_RANK + 1 / SHA256_GB_PER_S), 1
        ),
    }


EVAL_ROWS_CAP = 64  # beyond this, a bigger evaluation batch saves few forward passes on benchmark-sized document sets


def eval_bytes_per_row(config: PretrainConfig, shape: dict[str, Any]) -> float:
    """Device memory one row of an evaluation batch takes beyond the resident training state: its logits in bf16 and
    their fp32 log-softmax, a generation cache as long as a training row, and one layer's no-grad activations."""
    seq, hidden, layers = config.max_seq_length, shape["hidden_size"], shape["num_hidden_layers"]
    heads = shape["num_attention_heads"]
    kv_dim = (shape.get("num_key_value_heads") or heads) * (hidden // heads)
    logits = seq * shape["vocab_size"] * (2 + 4)
    kv_cache = 2 * layers * kv_dim * seq * 2
    return logits + kv_cache + 16 * seq * hidden


def eval_rows_that_fit(config: PretrainConfig, shape: dict[str, Any], memory: dict[str, float],
                       gpu_memory_gb: float | None) -> int | None:  # fmt: skip
    """The largest evaluation batch per GPU (at most EVAL_ROWS_CAP) in the memory training leaves free while it
    evaluates: the step's activations and logits are released, everything else stays. None without a GPU size."""
    if gpu_memory_gb is None:
        return None
    resident = memory["total"] - memory["activations"] - memory["logits"] - memory["allocator_margin"]
    headroom_bytes = (gpu_memory_gb * (1 - ALLOCATOR_MARGIN) - resident) * GB
    return max(0, min(EVAL_ROWS_CAP, int(headroom_bytes // eval_bytes_per_row(config, shape))))

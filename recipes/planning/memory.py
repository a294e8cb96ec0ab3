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
    """Host memory per node by term in GB, at its peak (a resume): fp32 master weights, Adam moments and fp32 gradients
    when offloaded, and the optimizer files a resume reads."""
    nodes, per_node = hardware.nodes, hardware.gpus_per_node
    host: dict[str, float] = {}
    host["offloaded_optimizer"] = (16 * params / nodes / GB) if offloads(ds_config, "optimizer") else 0.0
    host["offloaded_parameters"] = (2 * params / nodes / GB) if offloads(ds_config, "param") else 0.0
    # A resume reads each rank's optimizer file (fp32 master and moments, 12 bytes per parameter) whole into host
    # memory (torch.load, no mmap) before it copies it into place: with the optimizer offloaded the master and
    # gradient buffers (8) exist then and the moments (8) not yet, so the peak is 20 bytes per parameter, 4 above the
    # steady 16; without offload the file passes through host memory on its way to the GPU
    load = 4 if offloads(ds_config, "optimizer") else 12
    host["resume_read"] = load * params / nodes / GB
    host["training_processes"] = HOST_OVERHEAD_PER_RANK_GB * per_node
    host["dataloader_workers"] = HOST_PER_DATALOADER_WORKER_GB * config.dataloader_num_workers * per_node
    return {k: round(v, 3) for k, v in host.items()}


def checkpoint_terms(config: PretrainConfig, params: int, world: int) -> dict[str, float]:
    # fp32 master weights and Adam moments: under ZeRO-3 DeepSpeed's model-states files hold no weights (the
    # parameters are partitions, kB per rank); the bf16 weights are the master's, rounded, and are not saved
    checkpoint_gb = 12 * params / GB
    keep = (config.save_total_limit or 1) + 1  # the new checkpoint is complete before the oldest goes
    return {
        "checkpoint_gb": round(checkpoint_gb, 1),
        "checkpoint_disk_gb": round(checkpoint_gb * keep, 1),
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

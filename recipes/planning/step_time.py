"""How long a ZeRO-3 step takes on given wires: compute, the collectives ZeRO-3 issues, the optimizer on the host.

Per micro-batch, every GPU:
- computes forward and backward (and the recomputed forward with gradient checkpointing) at `compute_efficiency`
  of its peak: the fraction that large bf16 matmuls reach when nothing waits on the network;
- all-gathers the bf16 parameters for the forward, and again for the backward: the recomputed forward of a
  checkpointed block gathers each of its layers, and DeepSpeed keeps a layer for its backward only when that
  backward comes within `stage3_max_reuse_distance` parameters of use (`gathers_per_micro_batch`; otherwise it is
  gathered a third time). Parameters of modules smaller than
  `stage3_param_persistence_threshold` stay resident and are not gathered (in a Llama: the norms);
- reduce-scatters the bf16 gradients (ZeRO-3 reduces every micro-batch, not only at the step).

A collective over W GPUs on N nodes of G moves (W-1)/W of the tensor through each GPU's intra-node link and
(N-1)/N of it through each node's inter-node link; the slower of the two sets its time (bandwidth-bound: a
70B model's buckets are hundreds of MB, so latency is ignored). ZeRO++ changes the bytes: qwZ gathers int8
weights (half; every gather without hpZ), hpZ keeps a secondary bf16 copy of the parameters partitioned inside
each node so that the backward gathers never leave the node, qgZ reduces int4 gradients hierarchically (a
quarter).

Parameter offload adds a host-to-GPU copy of each GPU's partition before every gather. Optimizer offload adds,
per step, CPU Adam over the node's share of the parameters, bounded by host memory bandwidth (reading fp32
master weights, gradients and both moments, writing weights and moments and the bf16 copy: 30 bytes per
parameter), and the copy of the updated bf16 partition back to the GPU; the gradient copies to the host
overlap the backward.

DeepSpeed overlaps prefetched gathers and bucketed reductions with compute, imperfectly: a fraction `overlap` of
the shorter of compute and communication is hidden. The exposed communication is what remains.

ZeRO-3 also costs host time: Python hooks before and after every module with parameters fetch, release and
account for its partitions, in the forward, the backward (about twice the forward's hook work) and a recomputed
forward. A leaf module (`zero3_leaf_modules`, by default each decoder layer) is hooked once for everything inside
it; the per-tensor part of the work (gathering, partitioning and reducing each weight) stays. The GPU runs while
the host enqueues, so a micro-batch takes the longer of its kernels and its host work.
Measured on one H200 (docs/gpu-results.md, 1.1B model, 201 such modules): ~0.6 ms per module per forward pass,
in generation and in training alike, which made that model host-bound (11.6 % MFU under ZeRO-3 against 37.8 % in
plain torch). A 70B model has 723 such modules and ~60x the FLOPs per token: there the host work hides behind the
kernels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

GB = 1e9
CPU_ADAM_BYTES_PER_PARAM = 30  # fp32 param, grad, m, v read (16); param, m, v written (12); bf16 copy written (2)
# ZeRO-3's host work per forward pass (backward: 2 passes' worth), per module with parameters when every module is
# hooked: measured on an H200 machine's CPU (docs/gpu-results.md, 201 such modules, each holding one weight tensor);
# a slower host core raises it.
ZERO3_HOST_S_PER_MODULE_PASS = 0.6e-3
# Of that, the share that is per weight tensor (gathering, partitioning and reducing it), which leaf modules do not
# remove; the rest is per hooked module (its four hooks and their bookkeeping). Fitted on the CPU, where the same
# Python runs, by `python -m benchmarks.zero3_host_tax` (docs/training.md): 24 thin layers, 219 weight tensors; ZeRO-3's
# CPU time over plain torch per step with 219 hooked modules and with 27 (leaf layers), 0.258 and 0.077 s, gives
# 0.94 ms per hooked module and 0.24 ms per tensor, a share of 0.20 (an earlier run: 0.205 and 0.073 s, 0.27).
# Not yet measured on a GPU.
ZERO3_HOST_TENSOR_SHARE = 0.25
ZERO3_HOST_S_PER_HOOKED_MODULE_PASS = ZERO3_HOST_S_PER_MODULE_PASS * (1 - ZERO3_HOST_TENSOR_SHARE)
ZERO3_HOST_S_PER_TENSOR_PASS = ZERO3_HOST_S_PER_MODULE_PASS * ZERO3_HOST_TENSOR_SHARE


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model in its usual server. Bandwidths are what collectives achieve (nccl-tests bus bandwidth), not
    line rates."""

    peak_tflops: float  # dense bf16
    gpu_memory_gb: float
    intra_node_gb_s: float  # per GPU, inside a node (NVLink or PCIe)
    host_link_gb_s: float  # per GPU, to host memory (PCIe)
    host_memory_gb_s: float  # per node, what CPU Adam streams at
    gpus_per_node: int = 8


GPU_PROFILES = {
    # PCIe Gen4 x16 without NVLink: collectives cross the host bridge (nccl-tests: ~12-24 GB/s)
    "a800-pcie": GpuProfile(312, 80, 20, 20, 200),
    "a100-pcie": GpuProfile(312, 80, 20, 20, 200),
    # NVLink 3 behind NVSwitch: A100 600 GB/s bidirectional (~230 GB/s bus bandwidth), A800 capped at 400 GB/s
    "a800-sxm": GpuProfile(312, 80, 155, 20, 200),
    "a100-sxm": GpuProfile(312, 80, 230, 20, 200),
    # NVLink 4, 900 GB/s bidirectional (~360 GB/s bus bandwidth); PCIe Gen5 to the host
    "h100-sxm": GpuProfile(989, 80, 360, 45, 300),
    "h200-sxm": GpuProfile(989, 141, 360, 45, 300),
    # DGX-2 (16 V100 behind NVSwitch): only for checking the model against the ZeRO++ measurements
    "v100-dgx2": GpuProfile(125, 32, 120, 10, 150, gpus_per_node=16),
}
# inter-node bandwidth per node, as collectives achieve it: ~90 % of the line rate
INTERCONNECTS_GBPS = {"ib100": 100, "ib200": 200, "ib400": 400, "ib800": 800}
INTERCONNECT_EFFICIENCY = 0.9
DEFAULT_COMPUTE_EFFICIENCY = 0.6
DEFAULT_OVERLAP = 0.3


@dataclass(frozen=True)
class Wires:
    """The hardware the step-time model divides by."""

    peak_tflops: float
    intra_node_gb_s: float
    inter_node_gb_s: float | None  # per node; None on one node
    host_link_gb_s: float
    host_memory_gb_s: float
    compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY
    overlap: float = DEFAULT_OVERLAP


def wires_from(profile: str, interconnect: str | None, **overrides) -> Wires:
    """A GPU profile and an interconnect profile, each number overridable (None keeps the profile's)."""
    if profile not in GPU_PROFILES:
        raise ValueError(f"hardware profile {profile!r} is not one of {sorted(GPU_PROFILES)}")
    if interconnect is not None and interconnect not in INTERCONNECTS_GBPS:
        raise ValueError(f"interconnect {interconnect!r} is not one of {sorted(INTERCONNECTS_GBPS)}")
    gpu = GPU_PROFILES[profile]
    inter = INTERCONNECTS_GBPS[interconnect] / 8 * INTERCONNECT_EFFICIENCY if interconnect else None
    wires = Wires(gpu.peak_tflops, gpu.intra_node_gb_s, inter, gpu.host_link_gb_s, gpu.host_memory_gb_s)
    return replace(wires, **{key: value for key, value in overrides.items() if value is not None})


@dataclass(frozen=True)
class Zero3:
    """What the DeepSpeed JSON says about the traffic."""

    offload_optimizer: bool
    offload_param: bool
    persistence_threshold: float
    max_reuse_distance: float
    hpz_partition_size: int  # 1: off
    quantized_weights: bool
    quantized_gradients: bool

    @classmethod
    def from_json(cls, ds_config: dict[str, Any]) -> Zero3:
        zero = ds_config.get("zero_optimization", {})

        def device(key: str) -> bool:
            return (zero.get(key) or {}).get("device", "none") not in (None, "none")

        return cls(
            offload_optimizer=device("offload_optimizer"),
            offload_param=device("offload_param"),
            persistence_threshold=float(zero.get("stage3_param_persistence_threshold", 1e5)),
            max_reuse_distance=float(zero.get("stage3_max_reuse_distance", 1e9)),
            hpz_partition_size=int(zero.get("zero_hpz_partition_size", 1)),
            quantized_weights=bool(zero.get("zero_quantized_weights", False)),
            quantized_gradients=bool(zero.get("zero_quantized_gradients", False)),
        )


@dataclass(frozen=True)
class Workload:
    """One micro-batch of one GPU, and the model's sizes that set the traffic."""

    params: int
    persistent_params: int  # never gathered
    layer_params: int  # one decoder layer
    layers_per_checkpoint: int  # 0: no gradient checkpointing
    hardware_flops_per_token: float  # with recomputation
    useful_flops_per_token: float
    tokens_per_micro_batch: int
    accumulation: int
    gpus: int
    nodes: int
    hooked_modules: int = 0  # modules with parameters, a leaf module counting once: ZeRO-3 runs host hooks around each
    parameter_tensors: int = 0  # weight tensors: ZeRO-3 gathers, partitions and reduces each on its own


@dataclass
class StepTime:
    compute: float
    communication: float
    exposed_communication: float
    optimizer: float
    step: float
    predicted_mfu: float
    bound: str  # "compute", "communication" or "host"
    gathers_per_micro_batch: float
    traffic_gb: dict  # per micro-batch, per GPU (intra) and per node (inter)
    host: float = 0.0  # ZeRO-3's hook work per micro-batch

    def breakdown(self) -> dict[str, float]:
        return {key: round(value, 4) for key, value in asdict(self).items()
                if key in ("compute", "host", "communication", "exposed_communication", "optimizer")}  # fmt: skip


def host_s_per_pass(hooked_modules: int, parameter_tensors: int) -> float:
    """Host seconds of ZeRO-3's work for one forward pass over the model: per hooked module and per weight tensor."""
    return hooked_modules * ZERO3_HOST_S_PER_HOOKED_MODULE_PASS + parameter_tensors * ZERO3_HOST_S_PER_TENSOR_PASS


def collective_s(tensor_bytes: float, wires: Wires, gpus: int, nodes: int, intra_only: bool = False) -> float:
    """Seconds for an all-gather or reduce-scatter of a tensor of `tensor_bytes` over the GPUs."""
    per_node = gpus // nodes
    group = per_node if intra_only else gpus
    intra = (group - 1) / group * tensor_bytes / (wires.intra_node_gb_s * GB) if group > 1 else 0.0
    if intra_only or nodes == 1:
        return intra
    inter = (nodes - 1) / nodes * tensor_bytes / (wires.inter_node_gb_s * GB)
    return max(intra, inter)


def gathers_per_micro_batch(layers_per_checkpoint: int, layer_params: float, max_reuse_distance: float) -> float:
    """How many times each parameter is all-gathered per micro-batch, on average over the layers: once for the forward,
    and for the backward once, or twice where the gradient-checkpointed block's recompute gathers it and DeepSpeed
    releases it before its backward. Releasing a module, DeepSpeed scans the modules that come next in its trace until
    `max_reuse_distance` parameters are passed (the check falls before each module) and keeps the parameters it meets
    there (partitioned_param_coordinator's `__params_to_release`). In a block of k layers, layer j's recompute is
    followed by the recomputes of layers j+1..k-1 and the backwards of k-1..j+1: 2(k-1-j) layers before its own
    backward. (The 70B recipes' 2-layer blocks of 0.86B-parameter layers with the default 1e9: the first layer is
    gathered again, the second kept, 2.5.)"""
    if not layers_per_checkpoint:
        return 2.0  # forward, and backward (released in between: the rest of the model comes first)
    k = layers_per_checkpoint
    released = sum(1 for j in range(k) if 2 * (k - 1 - j) * layer_params >= max_reuse_distance)
    return 2.0 + released / k


def step_time(work: Workload, zero: Zero3, wires: Wires) -> StepTime:
    gathered_bytes = 2.0 * (work.params - work.persistent_params)
    gathers = gathers_per_micro_batch(work.layers_per_checkpoint, work.layer_params, zero.max_reuse_distance)
    hpz = zero.hpz_partition_size > 1 and work.nodes > 1
    quantized_bytes = gathered_bytes * (0.5 if zero.quantized_weights else 1.0)
    # the forward gather, then the backward ones: inside the node from hpZ's bf16 secondary copy, else like the first
    communication = collective_s(quantized_bytes, wires, work.gpus, work.nodes)
    if hpz:
        communication += (gathers - 1) * collective_s(gathered_bytes, wires, work.gpus, work.nodes, intra_only=True)
    else:
        communication += (gathers - 1) * collective_s(quantized_bytes, wires, work.gpus, work.nodes)
    gradient_bytes = 2.0 * work.params * (0.25 if zero.quantized_gradients else 1.0)
    communication += collective_s(gradient_bytes, wires, work.gpus, work.nodes)
    if zero.offload_param:
        communication += gathers * gathered_bytes / work.gpus / (wires.host_link_gb_s * GB)
    compute = (
        work.hardware_flops_per_token
        * work.tokens_per_micro_batch
        / (wires.peak_tflops * 1e12 * wires.compute_efficiency)
    )
    passes = 3 + (1 if work.layers_per_checkpoint else 0)  # forward, backward (2), recomputed forward
    host = passes * host_s_per_pass(work.hooked_modules, work.parameter_tensors)
    busy = max(compute, host)  # the GPU runs while the host enqueues: the longer of the two
    exposed = communication - wires.overlap * min(communication, busy)
    optimizer = 0.0
    if zero.offload_optimizer:
        adam = CPU_ADAM_BYTES_PER_PARAM * work.params / work.nodes / (wires.host_memory_gb_s * GB)
        upload = 2.0 * work.params / work.gpus / (wires.host_link_gb_s * GB)
        optimizer = adam + upload
    step = work.accumulation * (busy + exposed) + optimizer
    tokens_per_step = work.tokens_per_micro_batch * work.accumulation * work.gpus
    mfu = work.useful_flops_per_token * tokens_per_step / (step * work.gpus * wires.peak_tflops * 1e12)
    traffic = {
        "gather_per_gpu": round(gathers * gathered_bytes / GB, 2),
        "reduce_scatter_per_gpu": round(gradient_bytes / GB, 2),
    }
    bound = "communication" if communication > busy else "host" if host > compute else "compute"
    return StepTime(compute, communication, exposed, optimizer, step, mfu, bound, gathers, traffic, host)  # fmt: skip


def chinchilla(flops: float) -> tuple[float, float]:
    """(parameters, tokens) that spend `flops` compute-optimally: C = 6·N·D with D = 20·N (Hoffmann et al. 2022)."""
    params = math.sqrt(flops / (6 * 20))
    return params, 20 * params

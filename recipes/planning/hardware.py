"""The hardware a plan is for: the recipe's `hardware` block, command-line overrides, or the live launch."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.process import local_world_size
from recipes.config import (
    WIRE_KEYS,
    ConfigError,
    PretrainConfig,
)
from recipes.planning.step_time import (
    GPU_PROFILES,
    INTERCONNECT_EFFICIENCY,
    wires_from,
)

DEFAULT_MFU = 0.45  # without a hardware profile: the utilisation published large runs reach


@dataclass
class Hardware:
    gpus: int
    nodes: int
    gpu_memory_gb: float | None
    host_memory_gb: float | None
    peak_tflops: float | None
    mfu: float | None  # a fixed utilisation, in place of the communication model
    profile: str | None = None  # recipes.planning.step_time.GPU_PROFILES
    interconnect: str | None = None  # ib100, ib200, ib400, ib800 (between nodes)
    wires: dict = field(default_factory=dict)  # overrides of the profiles' numbers (WIRE_KEYS)

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def device(self) -> str:
        """What the plan calls a rank: a GPU where it knows one (its memory or a profile), else a process (a CPU
        rehearsal, whose `hardware.gpu_memory_gb` is null)."""
        return "GPU" if self.gpu_memory_gb is not None or self.profile else "process"

    @property
    def devices(self) -> str:
        return "GPUs" if self.device == "GPU" else "processes"

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
    cli = {key for key, value in overrides.items() if value is not None}  # named as flags, the rest as recipe keys
    wires = {key: block[key] for key in WIRE_KEYS if block.get(key) is not None}
    wires.update({key: overrides.pop(key) for key in WIRE_KEYS if overrides.get(key) is not None})
    given = {k: v for k, v in overrides.items() if v is not None and k not in WIRE_KEYS}
    values.update(given)
    for key in ("gpus", "nodes", "gpu_memory_gb", "host_memory_gb", "peak_tflops"):
        _check_physical(key, values[key], _name(key, cli))
    hardware = Hardware(**values, wires=wires)
    if hardware.profile and hardware.profile not in GPU_PROFILES:
        raise ConfigError(f"hardware profile {hardware.profile!r} is not one of {', '.join(sorted(GPU_PROFILES))}")
    if hardware.peak_tflops is None and hardware.profile:
        hardware.peak_tflops = GPU_PROFILES[hardware.profile].peak_tflops
    if hardware.mfu is None and not hardware.profile:
        hardware.mfu = DEFAULT_MFU
    if hardware.gpus % hardware.nodes:
        raise ConfigError(f"{_name('gpus', cli)} {hardware.gpus} is not divisible by {_name('nodes', cli)} "
                          f"{hardware.nodes}")  # fmt: skip
    _check_rates(hardware, cli)
    try:
        hardware.step_model()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return hardware


RECIPE_NAMES = {"peak_tflops": "peak_tflops_per_device"}  # the others: hardware.KEY


def _name(key: str, cli: set[str]) -> str:
    """A hardware value's name where it came from: `--mfu` on the command line, `hardware.mfu` in the recipe."""
    return f"--{key.replace('_', '-')}" if key in cli else RECIPE_NAMES.get(key, f"hardware.{key}")


def _check_rates(hardware: Hardware, cli: set[str]) -> None:
    """The fixed MFU in (0, 1], the wires' bandwidths positive and finite, their efficiency and overlap fractions."""
    if hardware.mfu is not None and not 0 < hardware.mfu <= 1:
        raise ConfigError(f"{_name('mfu', cli)} {hardware.mfu} must lie in (0, 1]")
    for key, value in hardware.wires.items():
        if key in ("compute_efficiency", "overlap"):
            low_ok = value >= 0 if key == "overlap" else value > 0
            if not low_ok or not value <= 1:
                valid = "in [0, 1]" if key == "overlap" else "in (0, 1]"
                raise ConfigError(f"{_name(key, cli)} {value}: must be {valid}")
        else:
            _check_physical(key, value, _name(key, cli))


def _check_physical(key: str, value, name: str) -> None:
    """A count of at least one, or an amount above zero: anything else makes every number of the plan a lie (a
    negative peak once printed "fits" at -33.7 % MFU). None: not known, and the plan says what it then skips."""
    if value is None:
        return
    if key in ("gpus", "nodes"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} {value!r}: must be a whole number of at least 1")
    elif isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ConfigError(f"{name} {value!r}: must be a positive number")


def live_hardware(config: PretrainConfig, world_size: int) -> Hardware:
    """The hardware this launch runs on. Without CUDA the recipe's `hardware.gpu_memory_gb` stands in
    for device memory (unset: no device-memory check), so CPU rehearsals can exercise the refusal."""
    import psutil
    import torch

    gpus_per_node = local_world_size()
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

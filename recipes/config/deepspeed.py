"""The DeepSpeed JSON owns ZeRO settings; the recipe owns optimisation. This module joins them.

The shared JSON writes `"auto"` for every value the recipe owns (batch sizes, clipping, precision).
`resolve_deepspeed_config` fills those from the recipe, and refuses a JSON that states a
concrete value which disagrees with the recipe, so no number silently has two homes.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from recipes.config import ConfigError, PretrainConfig

CONFIG_FILE_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
ZERO3_INIT_ENV = "ACCELERATE_DEEPSPEED_ZERO3_INIT"


def load_deepspeed_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config {path} not found (named by the accelerate config's deepspeed_config_file)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from None
    if config.get("zero_optimization", {}).get("stage") != 3:
        raise ConfigError(f"{path}: zero_optimization.stage must be 3 for this recipe")
    return config


def recipe_owned_values(config: PretrainConfig, world_size: int) -> dict[str, Any]:
    """DeepSpeed keys (dotted) whose one home is the recipe."""
    return {
        "train_micro_batch_size_per_gpu": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "train_batch_size": config.resolved_global_batch_size(world_size),
        "gradient_clipping": config.max_grad_norm,
        "bf16.enabled": config.bf16,
        "fp16.enabled": config.fp16,
    }


def resolve_deepspeed_config(ds_config: dict[str, Any], config: PretrainConfig, world_size: int) -> dict[str, Any]:
    """A copy of `ds_config` with every recipe-owned value filled in and checked."""
    resolved = copy.deepcopy(ds_config)
    conflicts = []
    for dotted, value in recipe_owned_values(config, world_size).items():
        *parents, leaf = dotted.split(".")
        node = resolved
        for part in parents:
            node = node.setdefault(part, {})
        current = node.get(leaf, "auto")
        if current == "auto":
            node[leaf] = value
        elif current != value:
            conflicts.append(f"{dotted}: DeepSpeed JSON says {current!r}, recipe gives {value!r}")
    # We build DeepSpeedCPUAdam ourselves (AdamW mode, per-group weight decay). Without this flag
    # accelerate "maps" any client optimizer to a new DeepSpeedCPUAdam with adamw_mode=False unless it
    # is torch's AdamW, silently turning decoupled weight decay into L2 regularisation that moves every
    # weight by the full learning rate each step (tests/test_zero3_parity.py catches it).
    resolved["zero_force_ds_cpu_optimizer"] = False
    if conflicts:
        raise ConfigError(
            'the DeepSpeed JSON and the recipe disagree; set these to "auto" in the JSON so the recipe '
            "decides:\n  " + "\n  ".join(conflicts)
        )
    return resolved


def offloads(ds_config: dict[str, Any], what: str) -> bool:
    """Whether ZeRO offloads `what` ("optimizer" or "param") to the host."""
    device = ds_config.get("zero_optimization", {}).get(f"offload_{what}", {}).get("device", "none")
    return device not in (None, "none")


def offloads_optimizer(ds_config: dict[str, Any]) -> bool:
    return offloads(ds_config, "optimizer")


def launched_config_path() -> str | None:
    """The DeepSpeed JSON that `accelerate launch` was told to use, if any."""
    path = os.environ.get(CONFIG_FILE_ENV)
    return None if path in (None, "", "none") else path


def zero3_init_requested() -> bool:
    return os.environ.get(ZERO3_INIT_ENV, "true").lower() in ("true", "1", "yes")

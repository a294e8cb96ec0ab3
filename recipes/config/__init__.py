"""Typed recipe config: YAML on disk, `--key value` overrides, every cross-field rule in one place.

`fields` holds the keys, `parsing` reads YAML and overrides (PyYAML loads `1e-4` as a string, so values are coerced
by each field's declared type: `learning_rate: 1e-4` and `--learning_rate 8e-5` both work), `checks` the rules, and
`deepspeed` resolves the DeepSpeed JSON against the recipe. The names below are what the rest of the package uses.
"""

from recipes.config.checks import (
    elastic_accumulation,
    for_world,
    missing_model_sizes,
    usable_nodes,
    validate_against_model,
    validate_for_world,
    validate_static,
    warmup_fraction,
)
from recipes.config.fields import (
    ATTN_IMPLEMENTATIONS,
    ATTN_MASKING_PATHS,
    HARDWARE_KEYS,
    MODEL_CONFIG_KEYS,
    WIRE_KEYS,
    ConfigError,
    PretrainConfig,
)
from recipes.config.parsing import apply_overrides, config_from_dict, load_config, parse_cli, parse_overrides

__all__ = [
    "ATTN_IMPLEMENTATIONS", "ATTN_MASKING_PATHS", "HARDWARE_KEYS", "MODEL_CONFIG_KEYS", "WIRE_KEYS", "ConfigError",
    "PretrainConfig", "apply_overrides", "config_from_dict", "elastic_accumulation", "for_world", "load_config",
    "missing_model_sizes", "parse_cli", "parse_overrides", "usable_nodes", "validate_against_model",
    "validate_for_world", "validate_static", "warmup_fraction",
]  # fmt: skip

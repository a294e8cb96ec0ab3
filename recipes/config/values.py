"""A recipe value from YAML or the command line, as its field's declared type (PyYAML loads `1e-4` as a string)."""

from __future__ import annotations

import types
import typing
from typing import Any

from recipes.config.fields import ConfigError


def coerce(key: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML or command-line value to the field's declared type, or say why it cannot."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(key, value, inner)
    if origin is list:
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return []  # `validation_files: null` means none, as [] does (a list key that can be unset is Optional)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [coerce(key, v, args[0]) for v in value]
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if annotation is int:
            if isinstance(value, bool):
                raise ValueError
            number = float(value) if isinstance(value, str) else value
            if float(number) != int(number):
                raise ValueError
            return int(number)
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if annotation is str:
            return str(value)
    except (TypeError, ValueError, OverflowError):  # int(inf) overflows: `total_tokens: .inf` is no count
        raise ConfigError(f"{key}: expected {annotation.__name__}, got {value!r}") from None
    raise ConfigError(f"{key}: unsupported type {annotation}")

"""A recipe from YAML and `--key value` overrides: parsing, coercion by each field's declared type, --help."""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from recipes.config.checks import validate_static
from recipes.config.fields import ConfigError, PretrainConfig, field_types
from recipes.config.values import coerce


def _yaml_problem(error: yaml.YAMLError) -> tuple[int | None, str]:
    """(1-based line, the parser's message) of a YAML error."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return (mark.line + 1 if mark is not None else None), problem


def _parse_scalar(key: str, text: str) -> Any:
    if text == "":
        return ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"--{key} {text!r}: not a valid YAML value ({_yaml_problem(error)[1]})") from None


def parse_overrides(argv: list[str]) -> list[tuple[list[str], Any]]:
    """`--key value` pairs into (key path, value); dotted keys reach into mappings."""
    overrides = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}: overrides are written --key value")
        key = token[2:]
        if "=" in key:
            key, text = key.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            text = argv[i + 1]
            i += 2
        else:
            raise ConfigError(f"--{key} needs a value")
        overrides.append((key.replace("-", "_").split("."), _parse_scalar(key, text)))
    return overrides


def apply_overrides(raw: dict[str, Any], overrides: list[tuple[list[str], Any]]) -> dict[str, Any]:
    """Set each value at its key path: `--a.b 1` changes one entry, `--a '{b: 1}'` replaces the mapping."""
    merged = copy.deepcopy(raw)
    for path, value in overrides:
        node = merged
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--{'.'.join(path)}: {part} is not a mapping")
            node = child
        node[path[-1]] = value
    return merged


def config_from_dict(raw: dict[str, Any], source: str = "config", cli_keys: set[str] | None = None) -> PretrainConfig:
    """Build and statically validate a config; unknown keys and wrong types are errors. `cli_keys` are the keys
    that came from the command line, so that an error says where a typo was made."""
    types_by_name = field_types()
    unknown = sorted(set(raw) - set(types_by_name))
    if unknown:
        raise ConfigError("; ".join(_unknown_key(key, source, key in (cli_keys or set())) for key in unknown))
    missing = [f.name for f in dataclasses.fields(PretrainConfig) if f.name not in raw and _is_required(f)]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
    values = {key: coerce(key, value, types_by_name[key]) for key, value in raw.items()}
    config = PretrainConfig(**values)
    validate_static(config)
    return config


def _unknown_key(key: str, source: str, from_cli: bool) -> str:
    import difflib

    where = f"--{key} on the command line" if from_cli else f"{key} in {source}"
    close = difflib.get_close_matches(key, list(field_types()), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "`recipes/pretrain.py --help` lists every key"
    return f"unknown key {where}: {hint}"


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def load_config(path: str | Path, argv: list[str] | None = None) -> PretrainConfig:
    """Read a recipe YAML and apply `--key value` overrides from `argv`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        line, problem = _yaml_problem(error)
        raise ConfigError(f"{path}:{line}: not valid YAML ({problem})") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte {error.start})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values at the top level")
    overrides = parse_overrides(argv or [])
    cli_keys = {key_path[0] for key_path, _ in overrides}
    return config_from_dict(apply_overrides(raw, overrides), source=str(path), cli_keys=cli_keys)


def _type_name(annotation: Any) -> str:
    """`float`, `int | None`, `list[str]`, `dict`: how a key's type reads in --help."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if origin is dict or annotation is dict:
        return "dict"
    return "None" if annotation is type(None) else annotation.__name__


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default) if isinstance(f.default, str) else str(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return str(f.default_factory())
    return "required"


def cli_parser(prog: str, description: str):
    """The entry point's arguments, with every recipe key listed as transformers' --help lists
    TrainingArguments: name, type, help and default. Parsing itself goes through `load_config`, which also
    takes dotted keys (`--model_config.hidden_size 512`) and YAML values (`--lr_scheduler_kwargs '{min_lr: 0}'`)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} --config YAML [--resume auto|none|PATH] [--KEY VALUE ...]",
        description=description,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/configs/tiny_cpu.yaml")
    parser.add_argument("--resume", help="auto (default), none, or a checkpoint directory")
    keys = parser.add_argument_group(
        "recipe keys", "Set in the YAML, or override any of them here: --key value (dotted keys reach into mappings)"
    )
    hints = field_types()
    for f in dataclasses.fields(PretrainConfig):
        type_name = _type_name(hints[f.name])
        keys.add_argument(
            f"--{f.name}",
            metavar=type_name.upper().replace(" ", ""),
            help=f"{f.metadata['help']}\n(type: {type_name}, default: {_default_text(f)})",
        )
    return parser


def parse_cli(argv: list[str] | None, prog: str, description: str) -> PretrainConfig:
    """`--config FILE [--resume X] [--key value ...]` into a validated config; `--help` prints every key."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = cli_parser(prog, description)
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        raise SystemExit(0)
    overrides, path, resume = [], None, None
    i = 0
    while i < len(argv):
        token = argv[i]
        name, _, inline = token.partition("=")
        if name in ("--config", "--resume"):
            value = inline if inline else (argv[i + 1] if i + 1 < len(argv) else None)
            if value is None:
                raise ConfigError(f"{name} needs a value")
            path, resume = (value, resume) if name == "--config" else (path, value)
            i += 1 if inline else 2
            continue
        overrides.append(token)
        i += 1
    if path is None:
        raise ConfigError("--config is required: the recipe YAML, e.g. --config recipes/configs/tiny_cpu.yaml")
    if resume:
        overrides += ["--resume_from_checkpoint", resume]
    return load_config(path, overrides)

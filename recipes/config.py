"""Typed recipe config: YAML on disk, `--key value` overrides, every cross-field rule in one place.

Keys follow Hugging Face `TrainingArguments` names wherever one exists. YAML is read with
PyYAML, which loads `1e-4` as a string (its float syntax needs a dot), so values are coerced by
each field's declared type: `learning_rate: 1e-4` and `--learning_rate 8e-5` both work.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from recipes.attention import MASKING_PATHS


class ConfigError(ValueError):
    """A recipe value that cannot work; the message names the key and what would be valid."""


LR_SCHEDULER_TYPES = ("cosine_with_min_lr", "cosine", "constant_with_warmup")
ATTN_IMPLEMENTATIONS = tuple(MASKING_PATHS)  # each with a path that masks packed documents
LOSS_SPIKE_ACTIONS = ("log", "rollback")
REPORT_TO = ("tensorboard", "wandb", "mlflow", "none")

# LlamaConfig keys a recipe may set under `model_config`; anything else is a typo, not a wish.
MODEL_CONFIG_KEYS: dict[str, type] = {
    "vocab_size": int,
    "hidden_size": int,
    "intermediate_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "max_position_embeddings": int,
    "rms_norm_eps": float,
    "rope_theta": float,
    "initializer_range": float,
    "tie_word_embeddings": bool,
    "hidden_act": str,
}

HARDWARE_KEYS = ("gpus", "nodes", "gpu_memory_gb", "host_memory_gb", "mfu", "profile", "interconnect",
                 "intra_node_gb_s", "inter_node_gbps", "host_link_gb_s", "host_memory_gb_s", "compute_efficiency",
                 "overlap")  # fmt: skip


@dataclass
class PretrainConfig:
    """One pretraining run. Field names follow `transformers.TrainingArguments` where one exists."""

    output_dir: str = field(metadata={"help": "Where metrics, checkpoints, `final/` and `loss.png` go."})
    tokenizer_name_or_path: str = field(
        metadata={"help": "Local tokenizer directory (or hub name when online); the model's vocabulary must cover it."}
    )
    train_files: list[str] | None = field(
        default=None,
        metadata={
            "help": (
                "Local jsonl / parquet / txt files (optionally .gz / .zst), a hub dataset name when online, or "
                "one directory written by `python -m data_prep.preprocess` (recognised by its manifest.json). "
                "Exclusive with train_mixture."
            )
        },
    )
    train_mixture: list[dict[str, Any]] | None = field(
        default=None,
        metadata={
            "help": (
                "Weighted preprocessed directories, [{path: DIR, weight: w}, ...], blended in exact proportions "
                "(set train_files: null)."
            )
        },
    )
    mixture_exhausted: str = field(
        default="repeat",
        metadata={"help": "When a train_mixture source runs out: repeat (its next epoch) or stop (end the run)."},
    )
    model_config: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "LlamaConfig values for a from-scratch model; `vocab_size` defaults to the tokenizer's size."
        },
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Continue from this local HF checkpoint instead of building `model_config` from scratch."},
    )
    validation_files: list[str] = field(
        default_factory=list, metadata={"help": "Held-out files for `eval_loss`; empty turns validation off."}
    )
    text_field: str = field(
        default="text", metadata={"help": "Field holding the document text in jsonl and parquet files."}
    )
    seed: int = field(default=42, metadata={"help": "Seed for model init and every rank's RNG."})

    max_seq_length: int = field(
        default=2048,
        metadata={"help": "Tokens per packed row; every row is exactly this long (EOS between documents, no padding)."},
    )
    per_device_train_batch_size: int = field(
        default=2, metadata={"help": "Micro-batch: packed rows per GPU per forward pass."}
    )
    per_device_eval_batch_size: int = field(default=2, metadata={"help": "Rows per GPU per validation forward pass."})
    gradient_accumulation_steps: int = field(
        default=8, metadata={"help": "Micro-batches per optimizer step on each GPU."}
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={
            "help": (
                "Rows per optimizer step over all GPUs; when set, micro x accumulation x world size must equal it."
            )
        },
    )

    learning_rate: float = field(
        default=1e-4, metadata={"help": "Peak AdamW learning rate, reached at the end of warmup."}
    )
    weight_decay: float = field(
        default=0.1, metadata={"help": "AdamW decoupled weight decay; never applied to norms or biases."}
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Gradient clipping by global norm (DeepSpeed `gradient_clipping`)."}
    )
    lr_scheduler_type: str = field(
        default="cosine_with_min_lr", metadata={"help": "One of cosine_with_min_lr, cosine, constant_with_warmup."}
    )
    lr_scheduler_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Extra schedule values; cosine_with_min_lr needs `min_lr`."}
    )
    warmup_steps: int = field(
        default=0, metadata={"help": "Optimizer steps of linear warmup from 0 to `learning_rate`."}
    )

    num_train_epochs: int = field(
        default=1,
        metadata={"help": "Passes over `train_files`; training stops at `max_steps` or when the last pass ends."},
    )
    max_steps: int = field(
        default=-1,
        metadata={"help": "Optimizer steps; -1 derives them from `total_tokens` / (global batch x max_seq_length)."},
    )
    total_tokens: int | None = field(
        default=None, metadata={"help": "Token budget of the run; used when `max_steps` is -1."}
    )

    bf16: bool = field(default=True, metadata={"help": "bf16 mixed precision (DeepSpeed `bf16.enabled`)."})
    fp16: bool = field(default=False, metadata={"help": "fp16 mixed precision with loss scaling; exclusive with bf16."})
    document_masking: bool = field(
        default=False,
        metadata={
            "help": (
                "No attention across EOS inside a packed row: position ids restart after every EOS, and each "
                "attention path masks per document at any micro-batch (flash_attention_2: varlen kernel with "
                "cumulative lengths the recipe passes; sdpa and eager: a block-diagonal mask). The run's first "
                "lines say which path it took."
            )
        },
    )
    attn_implementation: str = field(
        default="flash_attention_2",
        metadata={"help": "Requested attention; falls back to sdpa where flash-attn or CUDA is missing, and says so."},
    )
    gradient_checkpointing: bool = field(
        default=True, metadata={"help": "Recompute activations in the backward pass instead of storing them."}
    )
    gradient_checkpointing_layers_per_checkpoint: int = field(
        default=1, metadata={"help": "Decoder layers recomputed together: N stores one hidden state every N layers."}
    )

    logging_steps: int = field(
        default=10, metadata={"help": "Optimizer steps between metric lines (console, metrics.jsonl, TensorBoard)."}
    )
    eval_steps: int = field(default=1000, metadata={"help": "Optimizer steps between validation-loss evaluations."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Cap on packed validation rows per evaluation (all of them when unset)."}
    )
    save_steps: int = field(default=1000, metadata={"help": "Optimizer steps between checkpoints."})
    save_total_limit: int | None = field(
        default=None,
        metadata={"help": "Checkpoints kept on disk (oldest deleted after a new one is complete); unset keeps all."},
    )
    early_stopping_patience: int | None = field(
        default=None,
        metadata={"help": "Stop after this many evaluations without an eval_loss improvement; unset disables it."},
    )
    early_stopping_threshold: float = field(
        default=0.0, metadata={"help": "Minimum eval_loss decrease that counts as an improvement."}
    )
    loss_spike_factor: float | None = field(
        default=None,
        metadata={
            "help": (
                "A step whose loss (mean over ranks) exceeds this x the mean of the previous `loss_spike_window` "
                "steps is a spike; unset turns the rule off."
            )
        },
    )
    loss_spike_window: int = field(
        default=100, metadata={"help": "Steps in the running mean the spike rule compares against."}
    )
    loss_spike_action: str = field(
        default="log",
        metadata={
            "help": (
                "log: record the spike and go on; rollback: reload the last checkpoint and continue with the data"
                " after the spike, skipping the window between."
            )
        },
    )
    loss_spike_max_rollbacks: int = field(
        default=3,
        metadata={
            "help": (
                "Rollbacks before the rule only logs (spikes that keep coming back need a person, not more rollbacks)."
            )
        },
    )
    eval_tasks: list[str] = field(
        default_factory=list,
        metadata={"help": "Benchmarks run through lm-eval at evaluations: mmlu, gsm8k; empty turns them off."},
    )
    eval_limit: int | None = field(
        default=None, metadata={"help": "Documents per benchmark task (per MMLU subject); unset runs all of them."}
    )
    eval_benchmarks_every: int = field(
        default=1,
        metadata={
            "help": "Run the benchmarks at every k-th evaluation (and at the last step); eval_loss runs at every one."
        },
    )
    eval_num_fewshot: int = field(
        default=5,
        metadata={
            "help": "Few-shot examples per prompt (lm-eval's `num_fewshot`; the SPEC's MMLU and GSM8K are 5-shot)."
        },
    )
    eval_max_gen_toks: int | None = field(
        default=None, metadata={"help": "GSM8K answer budget in tokens; unset keeps lm-eval's 256."}
    )
    mmlu_dir: str | None = field(
        default=None,
        metadata={
            "help": "Local MMLU: the release layout (test/, dev/ csv) or a cais/mmlu snapshot; unset reads the hub."
        },
    )
    gsm8k_dir: str | None = field(
        default=None,
        metadata={
            "help": (
                "Local GSM8K: the release (test.jsonl, train.jsonl) or an openai/gsm8k snapshot; unset reads the hub."
            )
        },
    )

    dataloader_num_workers: int = field(default=0, metadata={"help": "Dataloader worker processes per GPU."})
    dataloader_pin_memory: bool = field(
        default=True, metadata={"help": "Pin host memory of batches (only takes effect with CUDA)."}
    )
    peak_tflops_per_device: float | None = field(
        default=312.0, metadata={"help": "Dense bf16 peak per device for MFU (A100/A800: 312); unset logs no MFU."}
    )
    hardware: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "What `recipes.plan` assumes: gpus, nodes, gpu_memory_gb, host_memory_gb (per node), "
            "profile (a800-pcie, a800-sxm, a100-pcie, a100-sxm, h100-sxm, h200-sxm), interconnect "
            "(ib100..ib800), overrides of the profile's bandwidths, or a fixed mfu."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": (
                "With resume_from_checkpoint none, delete the previous run's checkpoints and outputs in output_dir "
                "first; without it such a start is refused."
            )
        },
    )
    hang_timeout_s: float | None = field(
        default=1800.0,
        metadata={
            "help": (
                "A rank with no forward pass, optimizer step or save for this long dumps every thread's stack and "
                "exits 1 (so a requeue relaunches the run); also the dataloader's timeout. Unset turns it off."
            )
        },
    )
    resume_from_checkpoint: str = field(
        default="auto",
        metadata={
            "help": (
                "auto: the newest complete checkpoint in output_dir, if any; none: start fresh; or a checkpoint path."
            )
        },
    )
    report_to: list[str] = field(
        default_factory=lambda: ["tensorboard"],
        metadata={
            "help": (
                "Experiment trackers, through accelerate: tensorboard, wandb, mlflow (any of them), or none. "
                "metrics.jsonl is always written."
            )
        },
    )
    prometheus_port: int | None = field(
        default=None,
        metadata={
            "help": (
                "Serve the run's metrics for Prometheus on this port of every node's local rank 0 (e.g. 9555; not "
                "9400, dcgm-exporter's); unset serves nothing."
            )
        },
    )
    preflight_strict: bool = field(
        default=True,
        metadata={"help": "Stop at start-up when the plan says the run does not fit in GPU or host memory."},
    )

    def micro_tokens(self) -> int:
        return self.per_device_train_batch_size * self.max_seq_length

    def resolved_global_batch_size(self, world_size: int) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * world_size

    def total_steps(self, world_size: int) -> int:
        """Optimizer steps of the run: `max_steps`, or the token budget divided by tokens per step."""
        if self.max_steps > 0:
            return self.max_steps
        tokens_per_step = self.resolved_global_batch_size(world_size) * self.max_seq_length
        return self.total_tokens // tokens_per_step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(PretrainConfig)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML or command-line value to the field's declared type, or say why it cannot."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(key, v, args[0]) for v in value]
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
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {annotation.__name__}, got {value!r}") from None
    raise ConfigError(f"{key}: unsupported type {annotation}")


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
    types_by_name = _field_types()
    unknown = sorted(set(raw) - set(types_by_name))
    if unknown:
        raise ConfigError("; ".join(_unknown_key(key, source, key in (cli_keys or set())) for key in unknown))
    missing = [f.name for f in dataclasses.fields(PretrainConfig) if f.name not in raw and _is_required(f)]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
    values = {key: _coerce(key, value, types_by_name[key]) for key, value in raw.items()}
    config = PretrainConfig(**values)
    validate_static(config)
    return config


def _unknown_key(key: str, source: str, from_cli: bool) -> str:
    import difflib

    where = f"--{key} on the command line" if from_cli else f"{key} in {source}"
    close = difflib.get_close_matches(key, list(_field_types()), n=1, cutoff=0.6)
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


def _positive(config: PretrainConfig, *names: str) -> None:
    for name in names:
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name} must be > 0, got {getattr(config, name)}")


def validate_static(config: PretrainConfig) -> None:
    """Rules that need nothing but the config itself, each group naming the keys it checks."""
    _positive(
        config,
        "max_seq_length",
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "learning_rate",
        "logging_steps",
        "eval_steps",
        "save_steps",
        "num_train_epochs",
        "gradient_checkpointing_layers_per_checkpoint",
    )
    _validate_training_data(config)
    _validate_optimizer(config)
    if config.hang_timeout_s is not None and not 0 < config.hang_timeout_s < math.inf:
        raise ConfigError("hang_timeout_s must be a positive number of seconds, or null to turn the watchdog off")
    unknown_trackers = [name for name in config.report_to if name not in REPORT_TO]
    if unknown_trackers or ("none" in config.report_to and len(config.report_to) > 1):
        raise ConfigError(f"report_to {config.report_to}: use any of tensorboard, wandb, mlflow, or [none] alone")
    if config.prometheus_port is not None and not 1 <= config.prometheus_port <= 65535:
        raise ConfigError(f"prometheus_port must be a TCP port in 1-65535, or null; got {config.prometheus_port}")
    if config.bf16 and config.fp16:
        raise ConfigError("bf16 and fp16 are both true: choose one mixed-precision mode")
    if config.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"attn_implementation {config.attn_implementation!r} is not one of {ATTN_IMPLEMENTATIONS}")
    _validate_schedule(config)
    _validate_intervals(config)
    _validate_model_source(config)


def _validate_training_data(config: PretrainConfig) -> None:
    """train_files or train_mixture, not both; a mixture of {path, weight} entries with weights that blend."""
    if config.train_files is not None and config.train_mixture is not None:
        raise ConfigError("train_files and train_mixture are both set: a recipe with a mixture sets train_files: null")
    if config.train_mixture is None:
        if not config.train_files:
            raise ConfigError("train_files is empty: name at least one jsonl, parquet or txt file (or a train_mixture)")
        return
    if not config.train_mixture:
        raise ConfigError("train_mixture is empty: give [{path: DIR, weight: w}, ...]")
    for index, entry in enumerate(config.train_mixture):
        if set(entry) != {"path", "weight"} or not isinstance(entry["path"], str):
            raise ConfigError(f"train_mixture[{index}]: expected {{path: DIR, weight: w}}, got keys {sorted(entry)}")
        entry["weight"] = _coerce(f"train_mixture[{index}].weight", entry["weight"], float)
    if config.num_train_epochs != 1:
        raise ConfigError(
            "train_mixture: num_train_epochs must be 1 (mixture_exhausted says what a source does at its end)"
        )
    if config.mixture_exhausted not in ("repeat", "stop"):
        raise ConfigError(f"mixture_exhausted {config.mixture_exhausted!r} is not one of ['repeat', 'stop']")
    from data_prep.mixture import MixtureError, exact_weights

    try:
        exact_weights([entry["weight"] for entry in config.train_mixture])
    except MixtureError as error:
        raise ConfigError(f"train_mixture: {error}") from None


def _validate_optimizer(config: PretrainConfig) -> None:
    """AdamW's values where the update is defined: an lr or clipping of inf, or a beta of 1 or more, trains
    garbage without an error."""
    for name in ("learning_rate", "max_grad_norm", "adam_epsilon"):
        value = getattr(config, name)
        if not 0 < value < math.inf:
            raise ConfigError(f"{name} must be a positive finite number, got {value}")
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(config, name)
        if not 0 <= value < 1:
            raise ConfigError(f"{name} must lie in [0, 1), got {value} (AdamW's usual values: 0.9 and 0.95)")
    if not 0 <= config.weight_decay < math.inf:
        raise ConfigError(f"weight_decay must be >= 0 and finite, got {config.weight_decay}")


def _validate_schedule(config: PretrainConfig) -> None:
    if config.lr_scheduler_type not in LR_SCHEDULER_TYPES:
        raise ConfigError(
            f"lr_scheduler_type {config.lr_scheduler_type!r} is not supported; use one of {LR_SCHEDULER_TYPES}"
        )
    allowed_kwargs = {"min_lr"} if config.lr_scheduler_type == "cosine_with_min_lr" else set()
    extra = set(config.lr_scheduler_kwargs) - allowed_kwargs
    if extra:
        raise ConfigError(f"lr_scheduler_kwargs has {sorted(extra)}, which {config.lr_scheduler_type} does not take")
    if config.lr_scheduler_type == "cosine_with_min_lr":
        if "min_lr" not in config.lr_scheduler_kwargs:
            raise ConfigError("lr_scheduler_type cosine_with_min_lr needs lr_scheduler_kwargs.min_lr")
        min_lr = _coerce("lr_scheduler_kwargs.min_lr", config.lr_scheduler_kwargs["min_lr"], float)
        if not 0 <= min_lr <= config.learning_rate:
            raise ConfigError(
                f"lr_scheduler_kwargs.min_lr {min_lr} must lie in [0, learning_rate={config.learning_rate}]"
            )
        config.lr_scheduler_kwargs["min_lr"] = min_lr
    if config.warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be >= 0, got {config.warmup_steps}")
    if config.max_steps == 0 or config.max_steps < -1:
        raise ConfigError(f"max_steps must be > 0, or -1 to derive it from total_tokens; got {config.max_steps}")
    if config.max_steps == -1 and not config.total_tokens:
        raise ConfigError("max_steps is -1 but total_tokens is not set: give one of them")


def _validate_intervals(config: PretrainConfig) -> None:
    """Checkpoint rotation, early stopping, the loss-spike rule and benchmarks."""
    if config.save_total_limit is not None and config.save_total_limit < 1:
        raise ConfigError(f"save_total_limit must be >= 1 or unset, got {config.save_total_limit}")
    if config.early_stopping_patience is not None:
        if config.early_stopping_patience < 1:
            raise ConfigError(f"early_stopping_patience must be >= 1 or unset, got {config.early_stopping_patience}")
        if not config.validation_files:
            raise ConfigError("early_stopping_patience needs validation_files: it watches eval_loss")
    if config.loss_spike_factor is not None and config.loss_spike_factor <= 0:
        raise ConfigError(f"loss_spike_factor must be > 0 or unset, got {config.loss_spike_factor}")
    if config.loss_spike_window < 1 or config.loss_spike_max_rollbacks < 0:
        raise ConfigError("loss_spike_window must be >= 1 and loss_spike_max_rollbacks >= 0")
    if config.loss_spike_action not in LOSS_SPIKE_ACTIONS:
        raise ConfigError(f"loss_spike_action {config.loss_spike_action!r} is not one of {list(LOSS_SPIKE_ACTIONS)}")
    if config.eval_benchmarks_every < 1:
        raise ConfigError(f"eval_benchmarks_every must be >= 1, got {config.eval_benchmarks_every}")
    if config.eval_limit is not None and config.eval_limit < 1:
        raise ConfigError(f"eval_limit must be >= 1 or unset, got {config.eval_limit}")


def _validate_model_config(values: dict[str, Any]) -> None:
    """Each `model_config` value of the type and range LlamaConfig needs, before a 70B model is built on it."""
    unknown = set(values) - set(MODEL_CONFIG_KEYS)
    if unknown:
        raise ConfigError(f"model_config has unknown key(s) {sorted(unknown)}; valid: {', '.join(MODEL_CONFIG_KEYS)}")
    for key, value in values.items():
        kind = MODEL_CONFIG_KEYS[key]
        coerced = _coerce(f"model_config.{key}", value, kind)
        if kind in (int, float) and not 0 < coerced < math.inf:
            raise ConfigError(f"model_config.{key} must be a positive {kind.__name__}, got {value!r}")
        values[key] = coerced
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    if hidden and heads and hidden % heads:
        raise ConfigError(f"model_config.hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    kv_heads = values.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise ConfigError(
            f"model_config.num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}"
        )


def _validate_model_source(config: PretrainConfig) -> None:
    """model_config or model_name_or_path, hardware, and the global batch against the micro-batch."""
    if config.model_name_or_path and config.model_config:
        raise ConfigError(
            f"model_name_or_path {config.model_name_or_path} brings its own shape, so model_config must be empty "
            f"(it has {sorted(config.model_config)}); override it with --model_config '{{}}'"
        )
    if config.model_name_or_path is None and not config.model_config:
        raise ConfigError("give model_config (a from-scratch Llama shape) or model_name_or_path (a local HF model)")
    _validate_model_config(config.model_config)
    unknown_hardware_keys = set(config.hardware) - set(HARDWARE_KEYS)
    if unknown_hardware_keys:
        raise ConfigError(
            f"hardware has unknown key(s) {sorted(unknown_hardware_keys)}; valid: {', '.join(HARDWARE_KEYS)}"
        )
    if config.global_batch_size is not None:
        micro_x_accum = config.per_device_train_batch_size * config.gradient_accumulation_steps
        if config.global_batch_size % micro_x_accum:
            raise ConfigError(
                f"global_batch_size {config.global_batch_size} is not a multiple of per_device_train_batch_size "
                f"x gradient_accumulation_steps = {micro_x_accum}: no whole number of GPUs gives it"
            )


def validate_for_world(config: PretrainConfig, world_size: int) -> None:
    """Rules that need the live number of processes; checked before any model is built."""
    actual = config.resolved_global_batch_size(world_size)
    if config.global_batch_size is not None and actual != config.global_batch_size:
        raise ConfigError(
            f"per_device_train_batch_size ({config.per_device_train_batch_size}) x gradient_accumulation_steps "
            f"({config.gradient_accumulation_steps}) x world size ({world_size}) = {actual}, but "
            f"global_batch_size is {config.global_batch_size}. Launch on "
            f"{config.global_batch_size // (actual // world_size)} processes or change gradient_accumulation_steps."
        )
    if config.total_steps(world_size) < 1:
        raise ConfigError(
            f"total_tokens {config.total_tokens} is less than one optimizer step "
            f"({actual} rows x {config.max_seq_length} tokens)"
        )


def validate_against_model(config: PretrainConfig, *, vocab_size: int, tokenizer_size: int, max_positions: int) -> None:
    """Rules between the recipe, the model shape and the tokenizer."""
    if config.max_seq_length > max_positions:
        raise ConfigError(
            f"max_seq_length {config.max_seq_length} exceeds the model's max_position_embeddings {max_positions}: "
            "lower max_seq_length or raise model_config.max_position_embeddings"
        )
    if vocab_size < tokenizer_size:
        raise ConfigError(
            f"model vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_size} tokens "
            f"({config.tokenizer_name_or_path}): token ids would index past the embedding. "
            f"Set model_config.vocab_size >= {tokenizer_size} or leave it unset to use the tokenizer's size"
        )


def warmup_fraction(config: PretrainConfig, world_size: int) -> float:
    return config.warmup_steps / config.total_steps(world_size)


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
    hints = _field_types()
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

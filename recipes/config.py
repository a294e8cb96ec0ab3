"""Typed recipe config: YAML on disk, `--key value` overrides, every cross-field rule in one place.

Keys follow Hugging Face `TrainingArguments` names wherever one exists. YAML is read with
PyYAML, which loads `1e-4` as a string (its float syntax needs a dot), so values are coerced by
each field's declared type: `learning_rate: 1e-4` and `--learning_rate 8e-5` both work.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A recipe value that cannot work; the message names the key and what would be valid."""


LR_SCHEDULER_TYPES = ("cosine_with_min_lr", "cosine", "constant_with_warmup")
ATTN_IMPLEMENTATIONS = ("flash_attention_2", "sdpa", "eager")

# LlamaConfig keys a recipe may set under `model_config`; anything else is a typo, not a wish.
MODEL_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "initializer_range",
    "tie_word_embeddings",
    "hidden_act",
)

HARDWARE_KEYS = ("gpus", "nodes", "gpu_memory_gb", "host_memory_gb", "mfu")


@dataclass
class PretrainConfig:
    """One pretraining run. Field names follow `transformers.TrainingArguments` where one exists."""

    output_dir: str
    """Where metrics, checkpoints, `final/` and `loss.png` go."""
    tokenizer_name_or_path: str
    """Local tokenizer directory (or hub name when online); the model's vocabulary must cover it."""
    train_files: list[str]
    """Local jsonl / parquet / txt files (optionally .gz / .zst), a hub dataset name when online, or one
    directory written by `python -m data_prep.preprocess` (recognised by its manifest.json)."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """LlamaConfig values for a from-scratch model; `vocab_size` defaults to the tokenizer's size."""
    model_name_or_path: str | None = None
    """Continue from this local HF checkpoint instead of building `model_config` from scratch."""
    validation_files: list[str] = field(default_factory=list)
    """Held-out files for `eval_loss`; empty turns validation off."""
    text_field: str = "text"
    """Field holding the document text in jsonl and parquet files."""
    seed: int = 42
    """Seed for model init and every rank's RNG."""

    max_seq_length: int = 2048
    """Tokens per packed row; every row is exactly this long (EOS between documents, no padding)."""
    per_device_train_batch_size: int = 2
    """Micro-batch: packed rows per GPU per forward pass."""
    per_device_eval_batch_size: int = 2
    """Rows per GPU per validation forward pass."""
    gradient_accumulation_steps: int = 8
    """Micro-batches per optimizer step on each GPU."""
    global_batch_size: int | None = None
    """Rows per optimizer step over all GPUs; when set, micro x accumulation x world size must equal it."""

    learning_rate: float = 1e-4
    """Peak AdamW learning rate, reached at the end of warmup."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay; never applied to norms or biases."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (DeepSpeed `gradient_clipping`)."""
    lr_scheduler_type: str = "cosine_with_min_lr"
    """One of cosine_with_min_lr, cosine, constant_with_warmup."""
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra schedule values; cosine_with_min_lr needs `min_lr`."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `learning_rate`."""

    num_train_epochs: int = 1
    """Passes over `train_files`; training stops at `max_steps` or when the last pass ends."""
    max_steps: int = -1
    """Optimizer steps; -1 derives them from `total_tokens` / (global batch x max_seq_length)."""
    total_tokens: int | None = None
    """Token budget of the run; used when `max_steps` is -1."""

    bf16: bool = True
    """bf16 mixed precision (DeepSpeed `bf16.enabled`)."""
    fp16: bool = False
    """fp16 mixed precision with loss scaling; exclusive with bf16."""
    document_masking: bool = False
    """No attention across EOS inside a packed row: position ids restart after every EOS, which HF Llama
    turns into per-document attention (varlen with flash_attention_2, a block-diagonal mask with sdpa)."""
    attn_implementation: str = "flash_attention_2"
    """Requested attention; falls back to sdpa where flash-attn or CUDA is missing, and says so."""
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass instead of storing them."""
    gradient_checkpointing_layers_per_checkpoint: int = 1
    """Decoder layers recomputed together: N stores one hidden state every N layers."""

    logging_steps: int = 10
    """Optimizer steps between metric lines (console, metrics.jsonl, TensorBoard)."""
    eval_steps: int = 1000
    """Optimizer steps between validation-loss evaluations."""
    max_eval_samples: int | None = None
    """Cap on packed validation rows per evaluation (all of them when unset)."""
    save_steps: int = 1000
    """Optimizer steps between checkpoints."""
    save_total_limit: int | None = None
    """Checkpoints kept on disk (oldest deleted after a new one is complete); unset keeps all."""
    early_stopping_patience: int | None = None
    """Stop after this many evaluations without an eval_loss improvement; unset disables it."""
    early_stopping_threshold: float = 0.0
    """Minimum eval_loss decrease that counts as an improvement."""
    loss_spike_factor: float | None = None
    """A step whose loss (mean over ranks) exceeds this x the mean of the previous `loss_spike_window` steps
    is a spike; unset turns the rule off."""
    loss_spike_window: int = 100
    """Steps in the running mean the spike rule compares against."""
    loss_spike_action: str = "log"
    """log: record the spike and go on; rollback: reload the last checkpoint and continue with the data after
    the spike, skipping the window between."""
    loss_spike_max_rollbacks: int = 3
    """Rollbacks before the rule only logs (spikes that keep coming back need a person, not more rollbacks)."""
    eval_tasks: list[str] = field(default_factory=list)
    """Benchmarks run through lm-eval at evaluations: mmlu, gsm8k; empty turns them off."""
    eval_limit: int | None = None
    """Documents per benchmark task (per MMLU subject); unset runs all of them."""
    eval_benchmarks_every: int = 1
    """Run the benchmarks at every k-th evaluation (and at the last step); eval_loss runs at every one."""
    eval_num_fewshot: int = 5
    """Few-shot examples per prompt (lm-eval's `num_fewshot`; the SPEC's MMLU and GSM8K are 5-shot)."""
    eval_max_gen_toks: int | None = None
    """GSM8K answer budget in tokens; unset keeps lm-eval's 256."""
    mmlu_dir: str | None = None
    """Local MMLU: the release layout (test/, dev/ csv) or a cais/mmlu snapshot; unset reads the hub."""
    gsm8k_dir: str | None = None
    """Local GSM8K: the release (test.jsonl, train.jsonl) or an openai/gsm8k snapshot; unset reads the hub."""

    dataloader_num_workers: int = 0
    """Dataloader worker processes per GPU."""
    dataloader_pin_memory: bool = True
    """Pin host memory of batches (only takes effect with CUDA)."""
    peak_tflops_per_device: float | None = 312.0
    """Dense bf16 peak per device for MFU (A100/A800: 312); unset logs no MFU."""
    hardware: dict[str, Any] = field(default_factory=dict)
    """What `recipes.plan` assumes: gpus, nodes, gpu_memory_gb, host_memory_gb (per node), mfu."""
    resume_from_checkpoint: str = "auto"
    """auto: the newest complete checkpoint in output_dir, if any; none: start fresh; or a checkpoint path."""
    prometheus_port: int | None = None
    """Serve the run's metrics for Prometheus on this port of the main process; unset serves nothing."""
    preflight_strict: bool = True
    """Stop at start-up when the plan says the run does not fit in GPU or host memory."""

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


def _parse_scalar(text: str) -> Any:
    return yaml.safe_load(text) if text != "" else ""


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
        overrides.append((key.replace("-", "_").split("."), _parse_scalar(text)))
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


def config_from_dict(raw: dict[str, Any], source: str = "config") -> PretrainConfig:
    """Build and statically validate a config; unknown keys and wrong types are errors."""
    types_by_name = _field_types()
    unknown = sorted(set(raw) - set(types_by_name))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(unknown)}. Valid keys: {', '.join(sorted(types_by_name))}"
        )
    missing = [f.name for f in dataclasses.fields(PretrainConfig) if f.name not in raw and _is_required(f)]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
    values = {key: _coerce(key, value, types_by_name[key]) for key, value in raw.items()}
    config = PretrainConfig(**values)
    validate_static(config)
    return config


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def load_config(path: str | Path, argv: list[str] | None = None) -> PretrainConfig:
    """Read a recipe YAML and apply `--key value` overrides from `argv`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values at the top level")
    return config_from_dict(apply_overrides(raw, parse_overrides(argv or [])), source=str(path))


def _positive(config: PretrainConfig, *names: str) -> None:
    for name in names:
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name} must be > 0, got {getattr(config, name)}")


def validate_static(config: PretrainConfig) -> None:
    """Rules that need nothing but the config itself."""
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
    if not config.train_files:
        raise ConfigError("train_files is empty: name at least one jsonl, parquet or txt file")
    if config.bf16 and config.fp16:
        raise ConfigError("bf16 and fp16 are both true: choose one mixed-precision mode")
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
        min_lr = float(config.lr_scheduler_kwargs["min_lr"])
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
    if config.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"attn_implementation {config.attn_implementation!r} is not one of {ATTN_IMPLEMENTATIONS}")
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
    if config.loss_spike_action not in ("log", "rollback"):
        raise ConfigError(f"loss_spike_action {config.loss_spike_action!r} is not one of ['log', 'rollback']")
    if config.eval_benchmarks_every < 1:
        raise ConfigError(f"eval_benchmarks_every must be >= 1, got {config.eval_benchmarks_every}")
    if config.eval_limit is not None and config.eval_limit < 1:
        raise ConfigError(f"eval_limit must be >= 1 or unset, got {config.eval_limit}")
    if config.model_name_or_path and config.model_config:
        raise ConfigError(
            f"model_name_or_path {config.model_name_or_path} brings its own shape, so model_config must be empty "
            f"(it has {sorted(config.model_config)}); override it with --model_config '{{}}'"
        )
    if config.model_name_or_path is None and not config.model_config:
        raise ConfigError("give model_config (a from-scratch Llama shape) or model_name_or_path (a local HF model)")
    unknown_model_keys = set(config.model_config) - set(MODEL_CONFIG_KEYS)
    if unknown_model_keys:
        raise ConfigError(
            f"model_config has unknown key(s) {sorted(unknown_model_keys)}; valid: {', '.join(MODEL_CONFIG_KEYS)}"
        )
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

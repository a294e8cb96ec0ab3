"""Every cross-field rule of a recipe in one place, each naming the keys it checks and what would be valid."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from recipes.config.fields import (
    ATTN_IMPLEMENTATIONS,
    HARDWARE_KEYS,
    LOSS_SPIKE_ACTIONS,
    LR_SCHEDULER_TYPES,
    MODEL_CONFIG_KEYS,
    MODEL_SIZE_KEYS,
    REPORT_TO,
    ConfigError,
    PretrainConfig,
)
from recipes.config.values import coerce


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
    if config.dataloader_num_workers < 0:
        raise ConfigError(
            f"dataloader_num_workers must be >= 0 (0 loads batches in the training process), got "
            f"{config.dataloader_num_workers}"
        )
    if config.hang_timeout_s is not None and not 0 < config.hang_timeout_s < math.inf:
        raise ConfigError("hang_timeout_s must be a positive number of seconds, or null to turn the watchdog off")
    unknown_trackers = [name for name in config.report_to if name not in REPORT_TO]
    if unknown_trackers or ("none" in config.report_to and len(config.report_to) > 1):
        raise ConfigError(f"report_to {config.report_to}: use any of tensorboard, wandb, mlflow, or [none] alone")
    if config.prometheus_port is not None and not 1 <= config.prometheus_port <= 65535:
        raise ConfigError(f"prometheus_port must be a TCP port in 1-65535, or null; got {config.prometheus_port}")
    if not 0 <= config.metrics_linger_s <= 600:
        raise ConfigError(
            f"metrics_linger_s must be 0-600 seconds (one scrape interval or two); got {config.metrics_linger_s}"
        )
    if config.bf16 and config.fp16:
        raise ConfigError("bf16 and fp16 are both true: choose one mixed-precision mode")
    if config.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"attn_implementation {config.attn_implementation!r} is not one of {ATTN_IMPLEMENTATIONS}")
    if config.attn_implementation == "torch_varlen" and not (config.bf16 or config.fp16):
        raise ConfigError("attn_implementation torch_varlen runs in bf16 or fp16 only: set bf16: true (or fp16)")
    _validate_schedule(config)
    _validate_intervals(config)
    _validate_model_source(config)
    _validate_leaf_modules(config.zero3_leaf_modules)


def _validate_leaf_modules(names: list[str]) -> None:
    """Class names (LlamaDecoderLayer, or fully qualified), each once; whether the model has them is preflight's."""
    for name in names:
        if not all(part.isidentifier() for part in str(name).split(".")):
            raise ConfigError(
                f"zero3_leaf_modules: {name!r} is not a class name (e.g. LlamaDecoderLayer, or "
                "transformers.models.llama.modeling_llama.LlamaDecoderLayer); [] hooks every module"
            )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"zero3_leaf_modules lists {repeated} more than once")


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
        entry["weight"] = coerce(f"train_mixture[{index}].weight", entry["weight"], float)
    seen: dict[Path, int] = {}
    for index, entry in enumerate(config.train_mixture):
        where = Path(str(entry["path"])).resolve()
        if where in seen:
            raise ConfigError(
                f"train_mixture[{index}].path {entry['path']} is train_mixture[{seen[where]}]'s directory again: a "
                "source listed twice would have its share split without saying so; list it once with the summed weight"
            )
        seen[where] = index
    if config.num_train_epochs != 1:
        raise ConfigError(
            "train_mixture: num_train_epochs must be 1 (mixture_exhausted says what a source does at its end)"
        )
    if config.mixture_exhausted not in ("repeat", "stop"):
        raise ConfigError(f"mixture_exhausted {config.mixture_exhausted!r} is not one of ['repeat', 'stop']")
    from data_prep.parts.mixture import MixtureError, exact_weights

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
        min_lr = coerce("lr_scheduler_kwargs.min_lr", config.lr_scheduler_kwargs["min_lr"], float)
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
        coerced = coerce(f"model_config.{key}", value, kind)
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


def missing_model_sizes(shape: dict[str, Any]) -> list[str]:
    """The keys that size a model (MODEL_SIZE_KEYS) that `shape` lacks: the planner can count no parameters without
    them, and LlamaConfig would fill in its defaults."""
    return [key for key in MODEL_SIZE_KEYS if shape.get(key) is None]


def _validate_hardware(block: dict[str, Any]) -> None:
    """The `hardware` block's keys, and its numbers as numbers (PyYAML loads `1e3` as a string); their ranges are
    recipes.planning.hardware's, which names each key as the recipe or the command line gave it."""
    unknown = set(block) - set(HARDWARE_KEYS)
    if unknown:
        raise ConfigError(f"hardware has unknown key(s) {sorted(unknown)}; valid: {', '.join(HARDWARE_KEYS)}")
    for key, value in block.items():
        if value is not None and key not in ("profile", "interconnect"):
            block[key] = coerce(f"hardware.{key}", value, int if key in ("gpus", "nodes") else float)


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
    missing = missing_model_sizes(config.model_config)
    if config.model_name_or_path is None and missing:
        raise ConfigError(
            f"model_config has no {', '.join(missing)}: a from-scratch model needs {', '.join(MODEL_SIZE_KEYS)} "
            "(LlamaConfig's defaults are a 7B shape), or model_name_or_path (a model directory) instead"
        )
    _validate_hardware(config.hardware)
    if config.global_batch_size is not None and config.global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be >= 1 or unset, got {config.global_batch_size}")
    if config.elastic and config.global_batch_size is None:
        raise ConfigError("elastic: true needs global_batch_size, the batch it keeps on any number of processes")
    if config.elastic and config.global_batch_size % config.per_device_train_batch_size:
        raise ConfigError(f"global_batch_size {config.global_batch_size} is not a multiple of "
                          f"per_device_train_batch_size {config.per_device_train_batch_size}")  # fmt: skip
    if config.global_batch_size is not None and not config.elastic:
        micro_x_accum = config.per_device_train_batch_size * config.gradient_accumulation_steps
        if config.global_batch_size % micro_x_accum:
            raise ConfigError(
                f"global_batch_size {config.global_batch_size} is not a multiple of per_device_train_batch_size "
                f"x gradient_accumulation_steps = {micro_x_accum}: no whole number of GPUs gives it"
            )


def elastic_accumulation(config: PretrainConfig, world_size: int, per_node: int = 1) -> int:
    """gradient_accumulation_steps that keep global_batch_size on `world_size` processes (elastic runs); a count that
    cannot is refused naming those that can, and the node counts of `per_node` processes among them."""
    per_step = config.per_device_train_batch_size * world_size
    if config.global_batch_size % per_step:
        fits = [n for n in range(1, config.global_batch_size + 1)
                if config.global_batch_size % (config.per_device_train_batch_size * n) == 0]  # fmt: skip
        nodes = [n // per_node for n in fits if n % per_node == 0]
        in_nodes = f" (nodes of {per_node}: {', '.join(map(str, nodes)) or 'none'})" if per_node > 1 else ""
        raise ConfigError(
            f"elastic: global_batch_size {config.global_batch_size} cannot be kept on {world_size} processes "
            f"(per_device_train_batch_size {config.per_device_train_batch_size} x {world_size} does not divide it); "
            f"process counts that keep it: {', '.join(map(str, fits[:12]))}{', ...' if fits[12:] else ''}{in_nodes}"
        )
    return config.global_batch_size // per_step


def usable_nodes(config: PretrainConfig, given: int, per_node: int) -> int:
    """The most of `given` nodes of `per_node` processes an elastic recipe can train on while keeping its global batch
    (Slurm may start a job asked for --nodes=4-8 on 6: the recipe's 128 rows then train on 4 and 2 wait); all of them
    for a recipe that is not elastic, and 0 when no count keeps it."""
    if not config.elastic or not config.global_batch_size:
        return given
    micro = config.per_device_train_batch_size
    return next((n for n in range(given, 0, -1) if config.global_batch_size % (micro * n * per_node) == 0), 0)


def for_world(config: PretrainConfig, world_size: int) -> PretrainConfig:
    """The recipe as a launch of `world_size` processes runs it: an elastic one keeps its global batch, and its
    accumulation follows the world size; any other is as written."""
    if not config.elastic:
        return config
    return dataclasses.replace(config, gradient_accumulation_steps=elastic_accumulation(config, world_size))


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


def validate_against_model(config: PretrainConfig, *, vocab_size: int, max_positions: int,
                           tokenizer_size: int | None = None) -> None:  # fmt: skip
    """Rules between the recipe, the model shape and the tokenizer (None: not read, as in the planner)."""
    if config.max_seq_length > max_positions:
        raise ConfigError(
            f"max_seq_length {config.max_seq_length} exceeds the model's max_position_embeddings {max_positions}: "
            "lower max_seq_length or raise model_config.max_position_embeddings"
        )
    if tokenizer_size is not None and vocab_size < tokenizer_size:
        raise ConfigError(
            f"model vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_size} tokens "
            f"({config.tokenizer_name_or_path}): token ids would index past the embedding. "
            f"Set model_config.vocab_size >= {tokenizer_size} or leave it unset to use the tokenizer's size"
        )


def warmup_fraction(config: PretrainConfig, world_size: int) -> float:
    return config.warmup_steps / config.total_steps(world_size)

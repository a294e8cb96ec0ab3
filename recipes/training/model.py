"""Model construction: Llama config, attention choice, partitioned init, checkpointing, optimizer groups."""

from __future__ import annotations

import copy
import functools
import importlib.util
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from recipes.config import ConfigError, PretrainConfig


def choose_attn_implementation(requested: str, *, cuda_available: bool, flash_attn_installed: bool,
                               torch_varlen: tuple[bool, str] = (False, "")) -> tuple[str, str]:  # fmt: skip
    """The attention kernel to use and why: flash-attn needs both the package and a CUDA device; torch's varlen
    kernel (`torch_varlen`: whether it is usable, and why) a torch that has it and a CUDA device; flex_attention a
    CUDA device for its backward (torch 2.13 refuses it on the CPU, at the first backward)."""
    if requested == "flex_attention" and not cuda_available:
        return "sdpa", "flex_attention requested but its backward runs on CUDA only; using sdpa"
    if requested == "torch_varlen":
        usable, why = torch_varlen
        return ("torch_varlen", why) if usable else ("sdpa", f"torch_varlen requested but {why}; using sdpa")
    if requested != "flash_attention_2":
        return requested, f"{requested} requested"
    if not cuda_available:
        return "sdpa", "flash_attention_2 requested but no CUDA device is visible; using sdpa"
    if not flash_attn_installed:
        return "sdpa", (
            "flash_attention_2 requested but flash-attn is not installed (the wheel built for your torch "
            "and CUDA from flash-attn's releases, docs/training.md); using sdpa"
        )
    return "flash_attention_2", "flash_attention_2 requested; flash-attn and CUDA are present"


def detect_attn_implementation(requested: str) -> tuple[str, str]:
    from recipes.training import torch_varlen

    chosen = choose_attn_implementation(
        requested,
        cuda_available=torch.cuda.is_available(),
        flash_attn_installed=importlib.util.find_spec("flash_attn") is not None,
        torch_varlen=torch_varlen.available() if requested == torch_varlen.NAME else (False, ""),
    )
    if chosen[0] == torch_varlen.NAME:
        torch_varlen.register()  # before a model names it
    return chosen


def llama_config(config: PretrainConfig, tokenizer_size: int) -> LlamaConfig:
    """The model shape: `model_config` from the recipe, or the config of `model_name_or_path` without its pad id (an
    export's carries the tokenizer's, `with_token_ids`: the embedding would freeze that row, EOS's when pad is EOS)."""
    if config.model_name_or_path:
        model_config = AutoConfig.from_pretrained(config.model_name_or_path)
        model_config.pad_token_id = None
    else:
        values: dict[str, Any] = {"vocab_size": tokenizer_size, **config.model_config}
        model_config = LlamaConfig(**values)
    model_config.use_cache = False
    return model_config


def with_token_ids(model_config, tokenizer):
    """The model config with the tokenizer's bos/eos/pad ids: generation stops at the tokenizer's EOS, not at a
    LlamaConfig default (id 2 is an ordinary byte token in a tokenizer made by data_prep.train_tokenizer). For an
    exported model only: in training, `pad_token_id` would make the embedding freeze that row at zero, and some
    tokenizers use EOS as their pad."""
    model_config.bos_token_id = tokenizer.bos_token_id
    model_config.eos_token_id = tokenizer.eos_token_id
    model_config.pad_token_id = tokenizer.pad_token_id
    return model_config


def build_model(config: PretrainConfig, model_config, attn_implementation: str, dtype: torch.dtype):
    """From scratch or from a local checkpoint. Under accelerate's `zero3_init_flag` transformers builds
    it inside `deepspeed.zero.Init`, so every parameter is partitioned as it is created."""
    if config.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(
            config.model_name_or_path, config=model_config, attn_implementation=attn_implementation, dtype=dtype
        )
    return AutoModelForCausalLM.from_config(model_config, attn_implementation=attn_implementation, dtype=dtype)


def enable_chunked_checkpointing(model: torch.nn.Module, layers_per_checkpoint: int) -> int:
    """Recompute decoder layers in chunks of `layers_per_checkpoint`, storing one hidden state per chunk.

    transformers checkpoints every layer on its own; the SPEC asks for a checkpoint every 2 layers
    (80 layers: 40 stored hidden states of 2048 x 8192 x 2 B = 34 MB per sequence each). When the model's own loop
    calls the first layer of a chunk, that call runs the whole chunk under `torch.utils.checkpoint`, each layer through
    its module call, hooks included: ZeRO-3 gathers one layer's parameters (a leaf layer's, or its submodules') and
    releases them before the next layer is gathered, and reduces a leaf layer's gradients after its own backward. The
    loop's calls of the chunk's other layers then pass the hidden state through without any hook, so nothing is
    gathered twice. Returns the number of checkpoints.
    """
    layers = model.model.layers
    chunks = [list(layers[i : i + layers_per_checkpoint]) for i in range(0, len(layers), layers_per_checkpoint)]
    for chunk in chunks:
        head, tail = chunk[0], chunk[1:]
        head.chunk_calls = tuple(torch.nn.Module.__call__.__get__(layer) for layer in chunk)  # hooks, then forward
        head.__class__ = _chunk_class(type(head), runs_chunk=True)
        for layer in tail:
            layer.__class__ = _chunk_class(type(layer), runs_chunk=False)
    return len(chunks)


def _run_chunk(calls, hidden_states, *args, **kwargs):
    for call in calls:
        hidden_states = call(hidden_states, *args, **kwargs)
    return hidden_states


def _checkpointed_chunk(self, hidden_states, *args, **kwargs):
    """The call of a chunk's first layer: the chunk, recomputed in the backward when training."""
    run = functools.partial(_run_chunk, self.chunk_calls)
    if self.training and torch.is_grad_enabled():
        return checkpoint(run, hidden_states, *args, use_reentrant=False, **kwargs)
    return run(hidden_states, *args, **kwargs)


def _passed_through(self, hidden_states, *args, **kwargs):
    """The call of a chunk's other layers from the model's loop: their chunk's first layer ran them already."""
    return hidden_states


_CHUNK_CLASSES: dict[tuple[type, bool], type] = {}


def _chunk_class(layer_class: type, runs_chunk: bool) -> type:
    """`layer_class` whose call (from the model's loop) runs its chunk, or passes through, before any module hook.
    Same name and module, so class-name rules (leaf modules, export) still match; a subclass, so isinstance holds.
    (Such a model cannot be pickled whole; nothing here does, and its state_dict is the same.)"""
    key = (layer_class, runs_chunk)
    if key not in _CHUNK_CLASSES:
        namespace = {
            "__call__": _checkpointed_chunk if runs_chunk else _passed_through,
            "__module__": layer_class.__module__,
            "__qualname__": layer_class.__qualname__,
        }
        _CHUNK_CLASSES[key] = type(layer_class.__name__, (layer_class,), namespace)
    return _CHUNK_CLASSES[key]


def module_class_names(model_config) -> set[str]:
    """Every module class of the model `model_config` describes, by short and fully qualified name: the model built
    with one decoder layer on the meta device (no memory; well under a second at any size)."""
    small = copy.deepcopy(model_config)
    small.num_hidden_layers = 1
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(small)]
    except KeyError:
        raise ConfigError(f"{type(small).__name__} has no causal language model class in transformers") from None
    with torch.device("meta"):  # the class itself: from_config would partition it under an active ZeRO-3 config
        model = model_class(small)
    return {name for module in model.modules() for name in (type(module).__name__, _qualified(type(module)))}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_leaf_modules(names: list[str], model_config) -> None:
    """Each `zero3_leaf_modules` name matches a module class of the model (DeepSpeed would only say, once the engine
    is built, that none of them did)."""
    if not names:
        return
    present = module_class_names(model_config)
    missing = [name for name in names if name not in present]
    if missing:
        short = sorted(name for name in present if "." not in name)
        raise ConfigError(
            f"zero3_leaf_modules: {missing} match no module of this model; its module classes are {short} "
            "(usually [LlamaDecoderLayer]; [] hooks every module)"
        )


def apply_leaf_modules(model: torch.nn.Module, names: list[str]) -> None:
    """Mark the modules of the classes `names` as ZeRO-3 leaves (DeepSpeed's `set_z3_leaf_modules`), before the
    engine registers its hooks: each leaf is fetched and released whole, with no hooks on the modules inside it."""
    if names:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, list(names))


def describe_granularity(names: list[str], hooked: int, per_module: int) -> str:
    """The start line that says how ZeRO-3 gathers this model: `hooked`, the modules the engine hooked
    (`zero3_hooked_modules`), and `per_module`, the model's modules (what it hooks without leaves)."""
    if not names:
        return f"ZeRO-3 granularity: every module (zero3_leaf_modules []): hooks on {hooked} modules"
    return (
        f"ZeRO-3 granularity: {', '.join(names)} gathered whole (zero3_leaf_modules): hooks on {hooked} modules "
        f"instead of {per_module}"
    )


# The qualified name of the forward pre-hook that fetches a module's parameters: DeepSpeed's ZeRO-3 engine registers
# it on each module it hooks, and on none inside a leaf (`_register_deepspeed_module`, deepspeed 0.19,
# deepspeed/runtime/zero/parameter_offload.py; `torch.compiler.disable` keeps the name).
ZERO3_FETCH_HOOK = "_register_deepspeed_module.<locals>._pre_forward_module_hook"


def zero3_hooked_modules(module: torch.nn.Module) -> int:
    """Modules that carry the ZeRO-3 engine's fetch hook, counted on the prepared model: what DeepSpeed hooked, not
    what the leaf flags say it should have (flags set after the engine was built change no hook)."""
    return sum(1 for sub_module in module.modules() if _has_zero3_fetch_hook(sub_module))


def _has_zero3_fetch_hook(module: torch.nn.Module) -> bool:
    hooks = module._forward_pre_hooks.values()
    return any(getattr(hook, "__qualname__", "").endswith(ZERO3_FETCH_HOOK) for hook in hooks)


def optimizer_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay only matrices: norms and biases (anything 1-D) keep weight_decay 0.

    Under ZeRO-3 local tensors are empty partitions, so the shape comes from `ds_shape`."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shape = getattr(param, "ds_shape", param.shape)
        (no_decay if len(shape) < 2 or name.endswith(".bias") else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, config: PretrainConfig, offload_optimizer: bool) -> torch.optim.Optimizer:
    """AdamW with the recipe's values. With the optimizer offloaded, DeepSpeed's CPU Adam (vectorised C++)
    runs the update on the host; torch's AdamW there would be several times slower."""
    groups = optimizer_param_groups(model, config.weight_decay)
    kwargs = {"lr": config.learning_rate, "betas": (config.adam_beta1, config.adam_beta2), "eps": config.adam_epsilon}
    if offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        ask_for_the_cpu_once()
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(groups, fused=torch.cuda.is_available(), **kwargs)


def ask_for_the_cpu_once() -> None:
    """DeepSpeed's CPU op builder asks py-cpuinfo about the CPU three times while it loads CPU Adam, and py-cpuinfo
    answers each time from a fresh subprocess: 3.4 s of every rank's start on the development machine (1.1 s each).
    The CPU does not change while a run lives: the first answer is kept."""
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def replay_cpu_adam_bias_correction(optimizer) -> int | None:
    """After a resume, bring DeepSpeed's CPU Adam to the state an uninterrupted run has; returns the step.

    Its C++ side keeps beta^t as a float multiplied by beta once per step; a fresh optimizer at step t
    computes pow(beta, t) instead, which differs in the last bit, and every later update with it. Replaying
    the counter (updates of zero elements) makes the resumed run bit-identical. No-op for other optimizers."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    cpu_adam = optimizer
    while cpu_adam is not None and not isinstance(cpu_adam, DeepSpeedCPUAdam):
        cpu_adam = getattr(cpu_adam, "optimizer", None)
    if cpu_adam is None:
        return None
    steps = {int(state["step"]) for state in cpu_adam.state.values() if "step" in state}
    if len(steps) != 1:
        return None
    step, nothing = steps.pop(), torch.zeros(0)
    group = cpu_adam.param_groups[0]
    beta1, beta2 = group["betas"]
    for t in range(1, step + 1):
        cpu_adam.ds_opt_adam.adam_update(
            cpu_adam.opt_id, t, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
            group["bias_correction"], nothing, nothing, nothing, nothing,
        )  # fmt: skip
    return step


def group_hyperparameters(optimizer) -> list[dict]:
    """Each parameter group's hyperparameters but its parameters, learning rate (set every step) and a step count
    some optimizers keep there (state, not a setting), for `restore_group_hyperparameters`."""
    return [{key: value for key, value in group.items() if key not in ("params", "lr", "step")}
            for group in innermost_optimizer(optimizer).param_groups]  # fmt: skip


def restore_group_hyperparameters(optimizer, kept: list[dict]) -> None:
    """Put back what `group_hyperparameters` kept. DeepSpeed's ZeRO-3 load of a universal checkpoint copies the first
    group's hyperparameters to every group (deepspeed 0.19, `load_hp_checkpoint_state_from_checkpoint_dir_stage3`),
    so after a world-size change the norms and biases were decayed like the weights (weight_decay 0.1, not 0): in
    fp32 the losses parted from an uninterrupted run's by 2.3e-5 within 10 steps, against 6e-8 for the change of
    summation order alone (benchmarks/elastic_drift.py)."""
    groups = innermost_optimizer(optimizer).param_groups
    if len(groups) != len(kept):
        raise RuntimeError(f"the optimizer has {len(groups)} parameter groups after the load, {len(kept)} before")
    for group, values in zip(groups, kept, strict=True):
        group.update(values)


def hyperparameter_changes(loaded: list[dict], built: list[dict]) -> list[str]:
    """What differs between the groups a checkpoint brought (`loaded`) and the recipe's (`built`), each once:
    `weight_decay 0.1 -> 0.05`."""
    changes = []
    for before, after in zip(loaded, built, strict=False):
        for key in sorted(after):
            said = f"{key} {before.get(key)} -> {after[key]}"
            if before.get(key) != after[key] and said not in changes:
                changes.append(said)
    return changes


def innermost_optimizer(optimizer):
    """The optimizer that holds the parameter groups, below accelerate's and DeepSpeed's wrappers."""
    while getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    return optimizer


def count_parameters(model: torch.nn.Module) -> int:
    """All parameters, including those ZeRO-3 has partitioned away from this rank."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def local_parameter_elements(model: torch.nn.Module) -> int:
    """Elements this rank holds; near 1/world of the total after partitioned init."""
    return sum(getattr(p, "ds_tensor", p).numel() for p in model.parameters())


def build_engine(config: PretrainConfig, model_config, attn_implementation: str, ds_config: dict, accelerator,
                 load_universal: bool):  # fmt: skip
    """The model (partitioned as it is created), its checkpointing and optimizer, prepared into the DeepSpeed
    engine; returns (engine, optimizer, number of parameters). A collective on every rank."""
    import logging

    from recipes.config.deepspeed import offloads_optimizer

    logger = logging.getLogger("pretrain")
    dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
    model = build_model(config, model_config, attn_implementation, dtype)
    num_params = count_parameters(model)
    logger.info(
        "model: %.4g parameters; this rank holds %d elements after partitioned init",
        num_params,
        local_parameter_elements(model),
    )
    per_module = sum(1 for _ in model.modules())
    apply_leaf_modules(model, config.zero3_leaf_modules)  # before the chunks rename classes and the engine hooks
    if config.gradient_checkpointing:
        per_chunk = min(config.gradient_checkpointing_layers_per_checkpoint, len(model.model.layers))  # as cut
        chunks = enable_chunked_checkpointing(model, config.gradient_checkpointing_layers_per_checkpoint)
        logger.info("gradient checkpointing: %d checkpoints of %d layer(s)", chunks, per_chunk)
    optimizer = build_optimizer(model, config, offloads_optimizer(ds_config))
    if load_universal:
        # read by DeepSpeed when the engine is built: load_checkpoint then takes the universal format
        accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    engine, optimizer = accelerator.prepare(model, optimizer)
    hooked = zero3_hooked_modules(engine.module)  # counted on the hooks DeepSpeed registered
    logger.info("%s", describe_granularity(config.zero3_leaf_modules, hooked, per_module))
    return engine, optimizer, num_params

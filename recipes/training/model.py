"""Model construction: Llama config, attention choice, partitioned init, checkpointing, optimizer groups."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from recipes.config import PretrainConfig


def choose_attn_implementation(requested: str, *, cuda_available: bool, flash_attn_installed: bool) -> tuple[str, str]:
    """The attention kernel to use and why: flash-attn needs both the package and a CUDA device."""
    if requested != "flash_attention_2":
        return requested, f"{requested} requested"
    if not cuda_available:
        return "sdpa", "flash_attention_2 requested but no CUDA device is visible; using sdpa"
    if not flash_attn_installed:
        return "sdpa", "flash_attention_2 requested but flash-attn is not installed (pip install '.[gpu]'); using sdpa"
    return "flash_attention_2", "flash_attention_2 requested; flash-attn and CUDA are present"


def detect_attn_implementation(requested: str) -> tuple[str, str]:
    return choose_attn_implementation(
        requested,
        cuda_available=torch.cuda.is_available(),
        flash_attn_installed=importlib.util.find_spec("flash_attn") is not None,
    )


def llama_config(config: PretrainConfig, tokenizer_size: int) -> LlamaConfig:
    """The model shape: `model_config` from the recipe, or the config of `model_name_or_path`."""
    if config.model_name_or_path:
        model_config = AutoConfig.from_pretrained(config.model_name_or_path)
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
    (80 layers: 40 stored hidden states of 2048 x 8192 x 2 B = 34 MB per sequence each). The first
    layer of a chunk runs the whole chunk under `torch.utils.checkpoint`; the others become
    pass-throughs when called by the model's own loop. Calling them through `forward` skips only
    the decoder layer's own hooks: it owns no parameters, so ZeRO-3 still gathers each submodule's.
    Returns the number of checkpoints.
    """
    layers = model.model.layers
    chunks = [list(layers[i : i + layers_per_checkpoint]) for i in range(0, len(layers), layers_per_checkpoint)]
    for chunk in chunks:
        head, tail = chunk[0], chunk[1:]
        real_forwards = [type(layer).forward.__get__(layer) for layer in chunk]

        def run_chunk(hidden_states, *args, _forwards=tuple(real_forwards), **kwargs):
            for forward in _forwards:
                hidden_states = forward(hidden_states, *args, **kwargs)
            return hidden_states

        def head_forward(hidden_states, *args, _run=run_chunk, _head=head, **kwargs):
            if _head.training and torch.is_grad_enabled():
                return checkpoint(_run, hidden_states, *args, use_reentrant=False, **kwargs)
            return _run(hidden_states, *args, **kwargs)

        head.forward = head_forward
        for layer in tail:
            layer.forward = _pass_through
    return len(chunks)


def _pass_through(hidden_states, *args, **kwargs):
    return hidden_states


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
    if config.gradient_checkpointing:
        chunks = enable_chunked_checkpointing(model, config.gradient_checkpointing_layers_per_checkpoint)
        per_chunk = config.gradient_checkpointing_layers_per_checkpoint
        logger.info("gradient checkpointing: %d checkpoints of %d layer(s)", chunks, per_chunk)
    optimizer = build_optimizer(model, config, offloads_optimizer(ds_config))
    if load_universal:
        # read by DeepSpeed when the engine is built: load_checkpoint then takes the universal format
        accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    engine, optimizer = accelerator.prepare(model, optimizer)
    return engine, optimizer, num_params

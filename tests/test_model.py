"""Model pieces that run without DeepSpeed: attention choice, chunked checkpointing, optimizer groups,
and the 70B shape's parameter count and FLOPs."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import recipes.training.model as model_module
from recipes.architecture import training_flops_per_token
from recipes.config import load_config
from recipes.training.model import (
    choose_attn_implementation,
    count_parameters,
    enable_chunked_checkpointing,
    optimizer_param_groups,
)
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("requested", "cuda", "flash", "expected", "reason_part"),
    [
        ("flash_attention_2", True, True, "flash_attention_2", "present"),
        ("flash_attention_2", False, True, "sdpa", "no CUDA"),
        ("flash_attention_2", True, False, "sdpa", "not installed"),
        ("sdpa", True, True, "sdpa", "requested"),
        ("eager", False, False, "eager", "requested"),
    ],
)
def test_attention_choice_and_reason(requested, cuda, flash, expected, reason_part):
    chosen, reason = choose_attn_implementation(requested, cuda_available=cuda, flash_attn_installed=flash)
    assert chosen == expected and reason_part in reason


def tiny_llama(layers=4, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def loss_and_grads(model, input_ids):
    model.zero_grad()
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layers_per_checkpoint", [1, 2, 3])
def test_chunked_checkpointing_is_exact_and_recomputes(monkeypatch, layers_per_checkpoint):
    input_ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = tiny_llama().train()
    chunked = tiny_llama().train()
    chunks = enable_chunked_checkpointing(chunked, layers_per_checkpoint)
    assert chunks == -(-4 // layers_per_checkpoint)

    checkpoint_calls = []
    real_checkpoint = model_module.checkpoint
    monkeypatch.setattr(
        model_module, "checkpoint", lambda *a, **k: checkpoint_calls.append(1) or real_checkpoint(*a, **k)
    )
    # A pre-hook: torch stops a recomputation as soon as the tensors backward needs are back, which
    # can be before a submodule's forward returns.
    attention_calls = []
    for layer in chunked.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: attention_calls.append(1))

    loss_plain, grads_plain = loss_and_grads(plain, input_ids)
    loss_chunked, grads_chunked = loss_and_grads(chunked, input_ids)
    assert loss_chunked == loss_plain
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_chunked[name], grad, rtol=0, atol=0, msg=name)
    assert len(checkpoint_calls) == chunks
    assert len(attention_calls) == 2 * 4, "every layer runs once forward and once more when recomputed"

    attention_calls.clear()
    with torch.no_grad():
        chunked.eval()
        eval_logits = chunked(input_ids=input_ids).logits
        plain.eval()
        torch.testing.assert_close(eval_logits, plain(input_ids=input_ids).logits)
    assert len(attention_calls) == 4, "no recomputation without gradients"


def test_norms_and_biases_get_no_weight_decay():
    model = tiny_llama(layers=2)
    decay, no_decay = optimizer_param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all("norm" in names[id(p)] for p in no_decay["params"])
    assert all(p.ndim == 2 for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize(("vocab_size", "billions"), [(32_000, 68.98), (128_256, 70.55)])
def test_70b_recipe_shape_has_the_spec_parameter_count(vocab_size, billions):
    recipe = load_config(REPO / "recipes/configs/llama70b_a800x8.yaml")
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **recipe.model_config))
    params = count_parameters(model)
    assert params / 1e9 == pytest.approx(billions, abs=0.005)
    if vocab_size == 32_000:
        flops = training_flops_per_token(params, 80, recipe.max_seq_length, 8192)
        assert flops / 1e9 == pytest.approx(430, abs=1)
        assert 8 * 312e12 / flops == pytest.approx(5_800, rel=0.01), "the SPEC's throughput ceiling on 8 GPUs"


def test_a_cpu_without_native_bf16_is_told_once_that_bf16_is_emulated():
    from recipes.training.startup import bf16_emulation_warning

    line = bf16_emulation_warning(bf16=True, cuda=False, native_bf16=False)
    assert "emulates" in line and "--bf16 false" in line and "\n" not in line
    assert bf16_emulation_warning(bf16=True, cuda=False, native_bf16=True) is None
    assert bf16_emulation_warning(bf16=True, cuda=True, native_bf16=False) is None
    assert bf16_emulation_warning(bf16=False, cuda=False, native_bf16=False) is None


def test_deepspeed_imports_lean_and_mlflow_still_imports_after():
    """Neither mlflow nor Muon's kernel compilation (seconds of every rank's start) comes with DeepSpeed; ZeRO-3's
    question "is the optimizer Muon?" is still answered (no)."""
    import subprocess
    import sys

    probe = (
        "import sys, torch; from recipes.training.startup import import_deepspeed_lean; "
        "import_deepspeed_lean(); assert 'deepspeed' in sys.modules; "
        "from deepspeed.autotuning import autotuner; assert not autotuner.has_mlflow; "
        "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam; "
        "adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]); "
        "assert not isinstance(adamw, MuonWithAuxAdam); "
        "assert 'deepspeed.runtime.zero.muon.original_muon' not in sys.modules, 'Muon compiled its kernels'; "
        "import mlflow; print(mlflow.__name__)"
    )
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                               env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"})  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip().endswith("mlflow")

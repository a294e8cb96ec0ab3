"""Model pieces that run without DeepSpeed: attention choice, chunked checkpointing, optimizer groups,
and the 70B shape's parameter count and FLOPs."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

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
        ("flex_attention", True, False, "flex_attention", "requested"),
        ("flex_attention", False, False, "sdpa", "backward runs on CUDA only"),
    ],
)
def test_attention_choice_and_reason(requested, cuda, flash, expected, reason_part):
    chosen, reason = choose_attn_implementation(requested, cuda_available=cuda, flash_attn_installed=flash)
    assert chosen == expected and reason_part in reason


def test_torch_varlen_is_chosen_only_where_its_kernel_runs():
    usable = choose_attn_implementation("torch_varlen", cuda_available=True, flash_attn_installed=False,
                                        torch_varlen=(True, "torch 2.13 varlen_attn"))  # fmt: skip
    assert usable == ("torch_varlen", "torch 2.13 varlen_attn")
    unusable = (False, "torch's varlen_attn runs on CUDA only")
    chosen, reason = choose_attn_implementation("torch_varlen", cuda_available=False, flash_attn_installed=False,
                                                torch_varlen=unusable)  # fmt: skip
    assert chosen == "sdpa" and "CUDA only" in reason


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


def test_torch_varlen_sends_padded_and_cached_batches_to_sdpa_with_their_mask():
    """Without CUDA its kernel cannot run, but the routing can be seen: a batch with a padding mask, or a cached
    decoding step (fewer queries than keys), goes to sdpa with the mask transformers built; whole rows do not."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from recipes.training import torch_varlen

    class Attention(torch.nn.Module):
        is_causal, num_key_value_groups = True, 2

    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[0, ..., :2] = False
    routed, _ = torch_varlen.varlen_attention(Attention(), query, key, value, mask, scaling=0.3)
    direct, _ = sdpa_attention_forward(Attention(), query, key, value, mask, scaling=0.3)
    assert torch.equal(routed, direct)
    step, _ = torch_varlen.varlen_attention(Attention(), query[:, :, -1:], key, value, None, scaling=0.3)
    assert torch.equal(step, sdpa_attention_forward(Attention(), query[:, :, -1:], key, value, None, scaling=0.3)[0])
    assert torch_varlen.varlen_mask(2, 6, 6, attention_mask=None) is None, "whole rows: the kernel masks"
    over_cache = torch_varlen.varlen_mask(2, 3, 6, kv_offset=0, q_offset=3, attention_mask=None, dtype=torch.float32,
                                          allow_is_causal_skip=True)  # fmt: skip
    assert over_cache is not None and over_cache[0, 0].tolist()[0] == [True] * 4 + [False] * 2
    assert torch_varlen.branch(None, 6, 6, None) == "varlen" and torch_varlen.branch(mask, 6, 6, None) == "sdpa"
    assert (
        torch_varlen.branch(None, 6, 6, torch.tensor([0, 6])) == "varlen"
        and torch_varlen.branch(None, 1, 6, None) == "sdpa"
    )
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, NotImplementedError)):  # whole rows take the kernel, which needs CUDA
            torch_varlen.varlen_attention(Attention(), query, key, value, None, scaling=0.3)


def test_leaf_class_names_are_checked_against_the_model():
    from recipes.config import ConfigError
    from recipes.training.model import check_leaf_modules, module_class_names

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=80,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    names = module_class_names(config)
    assert {"LlamaDecoderLayer", "LlamaMLP", "transformers.models.llama.modeling_llama.LlamaDecoderLayer"} <= names
    check_leaf_modules(["LlamaDecoderLayer", "transformers.models.llama.modeling_llama.LlamaMLP"], config)
    check_leaf_modules([], config)
    with pytest.raises(ConfigError, match=r"zero3_leaf_modules: \['MistralDecoderLayer'\] match no module.*"
                                          r"LlamaDecoderLayer"):  # fmt: skip
        check_leaf_modules(["LlamaDecoderLayer", "MistralDecoderLayer"], config)


def test_a_chunk_tail_passes_through_without_hooks_and_keeps_its_class_name():
    """The model's own call of a layer inside a checkpointed chunk returns its input untouched and fires no module
    hook (ZeRO-3 would gather a leaf layer for nothing); the chunk's head runs it with its hooks."""
    model = tiny_llama(layers=4)
    calls = []
    for index, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda module, args, i=index: calls.append(i))
    enable_chunked_checkpointing(model, 2)
    tail = model.model.layers[1]
    assert type(tail).__name__ == "LlamaDecoderLayer" and isinstance(tail, LlamaDecoderLayer)
    hidden = torch.randn(1, 3, 32)
    assert tail(hidden, position_embeddings=None) is hidden and calls == []
    model.train()
    ids = torch.randint(0, 97, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls[:4] == [0, 1, 2, 3], "each layer's hooks once in the forward, tails inside their chunk"

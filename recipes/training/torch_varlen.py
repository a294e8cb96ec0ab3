"""torch's own variable-length attention as a transformers attention implementation, `torch_varlen`: packed documents
kept apart by flash-attn's varlen kernel as torch ships it (`torch.nn.attention.varlen.varlen_attn`, CUDA, bf16/fp16),
for clusters where the flash-attn wheel cannot be built.

transformers builds no mask for an attention function it does not know and hands it the keyword arguments the model
was called with, so the recipe's `cu_seq_lens_q/k` and `max_length_q/k` (`recipes.training.attention`, the same ones
flash_attention_2 gets) arrive here. A batch without them and without padding is B rows of one sequence each. A padded
batch (benchmarks through lm-eval) or a step of cached generation goes to sdpa with the mask transformers builds for
it, so that padding is masked as on every other path.
"""

from __future__ import annotations

import functools

NAME = "torch_varlen"


def available() -> tuple[bool, str]:
    """Whether this torch has the kernel and a GPU that runs it (flash attention: Ampere or newer), and if not, why."""
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if not torch.cuda.is_available():
        return False, "torch's varlen_attn runs on CUDA only"
    if torch.cuda.get_device_capability() < (8, 0):
        return False, f"torch's varlen_attn needs an Ampere or newer GPU, not {torch.cuda.get_device_name()}"
    return True, f"torch {torch.__version__} varlen_attn"


def branch(attention_mask, query_length: int, key_length: int, cu_seq_lens_q) -> str:
    """`varlen` (the kernel: packed documents, or whole rows) or `sdpa` (padding, or a cached decoding step)."""
    whole_rows = attention_mask is None and key_length == query_length
    return "varlen" if cu_seq_lens_q is not None or whole_rows else "sdpa"


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, cu_seq_lens_q=None,
                     cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):  # fmt: skip
    """(batch, heads, seq, dim) query, key and value in, (batch, seq, heads, dim) out, as transformers' functions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, seq, dim = query.shape
    if branch(attention_mask, seq, key.shape[2], cu_seq_lens_q) == "sdpa":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    if dropout:
        raise NotImplementedError(f"attn_implementation torch_varlen has no attention dropout (got {dropout})")
    import torch
    from torch.nn.attention.varlen import varlen_attn

    if cu_seq_lens_q is None:  # each row one causal sequence
        cu_seq_lens_q = cu_seq_lens_k = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
        max_length_q = max_length_k = seq
    kv_heads = key.shape[1]

    def tokens(tensor, count):  # (batch, count, seq, dim) -> (batch * seq, count, dim)
        return tensor.transpose(1, 2).reshape(batch * seq, count, dim)

    output = varlen_attn(
        tokens(query, heads), tokens(key, kv_heads), tokens(value, kv_heads),
        cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32), int(max_length_q), int(max_length_k),
        scale=scaling, window_size=(-1, 0), **gqa_keyword(varlen_attn, kv_heads != heads),
    )  # fmt: skip
    return output.reshape(batch, seq, heads, dim), None


@functools.cache
def _parameters(function) -> frozenset[str]:
    import inspect

    return frozenset(inspect.signature(function).parameters)


def gqa_keyword(varlen_attn, grouped: bool) -> dict[str, bool]:
    """torch 2.13's varlen_attn is told about fewer key/value heads than query heads (`enable_gqa`); 2.11's has no
    such argument (a TypeError at the first forward) and its flash kernel takes grouped heads as they are."""
    return {"enable_gqa": grouped} if "enable_gqa" in _parameters(varlen_attn) else {}


def varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                attention_mask=None, **kwargs):  # fmt: skip
    """No mask where the kernel runs (whole rows of queries over their own keys: it masks by sequence lengths); sdpa's
    elsewhere (padding, or queries over a cache)."""
    if attention_mask is None and q_length == kv_length and not q_offset and not kv_offset:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Make `torch_varlen` a name transformers accepts for `attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, varlen_mask)

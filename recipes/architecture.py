"""The Llama architecture's arithmetic, in one home: the modules that hold parameters and their sizes, the parameter
count and FLOPs per token. Pure (no torch), so the planner answers at once; the planner and the training loop read it.
"""

from __future__ import annotations

from typing import Any


def module_sizes(shape: dict[str, Any]) -> list[tuple[int, int]]:
    """(how many, parameters each) of every module with weights in a Llama without biases: the embeddings (and the
    untied output head), per layer q and o, k and v, gate, up and down, two RMSNorms, and the final norm. What ZeRO-3
    partitions and gathers, module by module."""
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads = shape["num_attention_heads"]
    kv_dim = (shape.get("num_key_value_heads") or heads) * (hidden // heads)
    embeddings = [(1 if shape.get("tie_word_embeddings") else 2, shape["vocab_size"] * hidden)]
    per_layer = [(2, hidden * hidden), (2, hidden * kv_dim), (3, hidden * shape["intermediate_size"]), (2, hidden)]
    return [*embeddings, *((count * layers, size) for count, size in per_layer), (1, hidden)]


def llama_parameter_count(**shape: Any) -> tuple[int, int]:
    """(all parameters, largest single module's parameters) of a Llama model of `shape` (LlamaConfig keys)."""
    sizes = module_sizes(shape)
    return sum(count * size for count, size in sizes), max(size for _, size in sizes)


def hooked_modules(shape: dict[str, Any]) -> int:
    """Modules with parameters: ZeRO-3 runs its fetch and release hooks around each of them in every pass."""
    return sum(count for count, _ in module_sizes(shape))


def training_flops_per_token(num_params: int, num_layers: int, seq_len: int, hidden_size: int) -> float:
    """6N for the matmuls forward and backward plus 12·L·s·h for attention scores (PaLM appendix B).

    Recomputation is not counted: MFU measures useful work, not work done twice."""
    return 6.0 * num_params + 12.0 * num_layers * seq_len * hidden_size

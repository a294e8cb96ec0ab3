"""The Llama architecture's arithmetic, in one home: the modules that hold parameters and their sizes, the parameter
count and FLOPs per token. Pure (no torch), so the planner answers at once; the planner and the training loop read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# LlamaConfig's default, for a `model_config` that does not set it (tests/test_plan.py pins it to transformers').
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048


def _per_layer(shape: dict[str, Any]) -> dict[str, list[tuple[int, int]]]:
    """(how many, parameters each) of one decoder layer's modules with weights, by the Llama class that holds them."""
    hidden = shape["hidden_size"]
    heads = shape["num_attention_heads"]
    kv_dim = (shape.get("num_key_value_heads") or heads) * (hidden // heads)
    return {
        "LlamaAttention": [(2, hidden * hidden), (2, hidden * kv_dim)],  # q and o, k and v
        "LlamaMLP": [(3, hidden * shape["intermediate_size"])],  # gate, up, down
        "LlamaRMSNorm": [(2, hidden)],  # before attention and before the MLP
    }


def module_sizes(shape: dict[str, Any]) -> list[tuple[int, int]]:
    """(how many, parameters each) of every module with weights in a Llama without biases: the embeddings (and the
    untied output head), per layer q and o, k and v, gate, up and down, two RMSNorms, and the final norm. Each holds one
    weight tensor. What ZeRO-3 partitions, and gathers module by module without leaf modules."""
    return [(count, size) for count, size, _ in _units(shape, ())]


# The Llama classes `zero3_leaf_modules` may name that change what ZeRO-3 gathers at once (a leaf RMSNorm, Embedding or
# Linear is one module with weights anyway).
WHOLE_MODEL_CLASSES = ("LlamaForCausalLM", "LlamaModel")
GROUPING_CLASSES = ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP")


def _units(shape: dict[str, Any], leaves: Sequence[str]) -> list[tuple[int, int, bool]]:
    """(how many, parameters each, whether a leaf class groups it) of what ZeRO-3 gathers as one."""
    names = {name.rsplit(".", 1)[-1] for name in leaves}
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    heads = 1 if shape.get("tie_word_embeddings") else 2  # input embeddings, and the untied output head
    embedding = shape["vocab_size"] * hidden
    groups = _per_layer(shape)
    if "LlamaDecoderLayer" in names:
        per_layer = [(1, sum(count * size for entries in groups.values() for count, size in entries), True)]
    else:
        per_layer = []
        for cls, entries in groups.items():
            if cls in names and cls in GROUPING_CLASSES:
                per_layer.append((1, sum(count * size for count, size in entries), True))
            else:
                per_layer += [(count, size, False) for count, size in entries]
    units = [(heads, embedding, False), *((count * layers, size, grouped) for count, size, grouped in per_layer),
             (1, hidden, False)]  # fmt: skip
    params = sum(count * size for count, size, _ in units)
    if "LlamaForCausalLM" in names:
        return [(1, params, True)]
    if "LlamaModel" in names:  # the output head lies outside it, hooked on its own
        head = (heads - 1) * embedding
        return [(1, params - head, True), *([(1, head, False)] if head else [])]
    return units


def gathered_units(shape: dict[str, Any], leaves: Sequence[str] = ()) -> list[tuple[int, int]]:
    """(how many, parameters each) of what ZeRO-3 fetches and releases as one, each with its own hooks: every module
    with weights, except that a leaf class (`zero3_leaf_modules`, short or fully qualified names) is one unit with
    everything inside it. Classes this Llama arithmetic does not know are counted module by module."""
    return [(count, size) for count, size, _ in _units(shape, leaves)]


def largest_leaf(shape: dict[str, Any], leaves: Sequence[str] = ()) -> int | None:
    """Parameters of the largest unit a leaf class gathers at once (a decoder layer, an attention or MLP block, the
    model); None when no leaf groups modules."""
    grouped = [size for _, size, by_leaf in _units(shape, leaves) if by_leaf]
    return max(grouped) if grouped else None


def unknown_leaf_classes(leaves: Sequence[str]) -> list[str]:
    """Leaf names the planner's arithmetic does not group (it counts their modules one by one)."""
    known = {*WHOLE_MODEL_CLASSES, *GROUPING_CLASSES, "LlamaRMSNorm", "Embedding", "Linear"}
    return [name for name in leaves if name.rsplit(".", 1)[-1] not in known]


def llama_parameter_count(**shape: Any) -> tuple[int, int]:
    """(all parameters, largest single module's parameters) of a Llama model of `shape` (LlamaConfig keys)."""
    sizes = module_sizes(shape)
    return sum(count * size for count, size in sizes), max(size for _, size in sizes)


def hooked_modules(shape: dict[str, Any], leaves: Sequence[str] = ()) -> int:
    """Units ZeRO-3 runs its fetch and release hooks around in each pass: modules with weights, a leaf counting once."""
    return sum(count for count, _ in gathered_units(shape, leaves))


def parameter_tensors(shape: dict[str, Any]) -> int:
    """Weight tensors: ZeRO-3 gathers, partitions and reduces each on its own, whatever the granularity of its hooks."""
    return sum(count for count, _ in module_sizes(shape))


def training_flops_per_token(num_params: int, num_layers: int, seq_len: int, hidden_size: int) -> float:
    """6N for the matmuls forward and backward plus 12·L·s·h for attention scores (PaLM appendix B).

    Recomputation is not counted: MFU measures useful work, not work done twice."""
    return 6.0 * num_params + 12.0 * num_layers * seq_len * hidden_size

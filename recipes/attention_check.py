"""Check that a recipe's packed batches keep documents apart on its attention path.

    python -m recipes.attention_check --config recipes/configs/tiny_cpu.yaml [--attn_implementation IMPL]
        [--num-layers N] [--dtype float32|bfloat16] [--key value ...]

Builds the recipe's model (any depth with `--num-layers`: attention is the same in every layer) and one micro-batch
of `per_device_train_batch_size` rows of `max_seq_length` tokens, packed from random documents the way training
packs them (`data_prep.packing`), with the model inputs training gives it (`recipes.training.attention`). Runs it,
runs every document alone, and prints one JSON line: `attn_implementation`, `micro_batch`, `document_masking`,
`path` (`varlen`, `block_mask` or `none`: the branch transformers took), `kernel`, `max_abs_diff` between the packed
logits and each document's own, and `ok` (the difference within `tolerance`). Exit code 0 when ok, 1 when not,
2 for bad input.

`flash_attention_2` needs flash-attn and a GPU. Without them the model runs through transformers' own flash-attention
entry points (`flash_attention_forward`, `_flash_attention_forward`, which choose the branch) with a reference
kernel in place of flash-attn's (`kernel: reference`): the branch is transformers' decision on the recipe's inputs,
and the difference is the reference kernel's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recipes.config import ConfigError, load_config

TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # bf16 logits of one kernel over two shapes differ in the 2nd digit
MAX_PARAMETERS = 3e9  # beyond this, shrink with --num-layers: the check needs the whole model on one device
PROBE_NAME = "recipe_varlen_probe"  # a name with "flash" in it would make transformers look for flash-attn


def packed_batch(rows: int, seq_len: int, vocab_size: int, eos_id: int, seed: int = 0):
    """`rows` packed rows of `seq_len` ids from random documents (mean length seq_len / 3), EOS after each."""
    import torch

    from data_prep.packing import pack_documents

    rng = random.Random(seed)
    ids = [i for i in range(min(vocab_size, 50_000)) if i != eos_id]

    def documents():
        while True:
            yield [rng.choice(ids) for _ in range(rng.randint(1, max(2, 2 * seq_len // 3)))]

    packed = pack_documents(documents(), seq_len, eos_id)
    return torch.tensor([next(packed) for _ in range(rows)])


def document_spans(row, eos_id: int) -> list[tuple[int, int]]:
    """[start, end) of every document in a row as training sees it: up to and including an EOS, and the row's ends."""
    spans, start = [], 0
    for index, token in enumerate(row.tolist()):
        if token == eos_id:
            spans.append((start, index + 1))
            start = index + 1
    if start < len(row):
        spans.append((start, len(row)))
    return spans


def _reference_varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, softmax_scale=None, **_):
    """flash-attn's varlen kernel in plain torch: causal attention inside each [cu[i], cu[i+1]) of (tokens, H, D)."""
    import torch

    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        out[start:end] = _causal(q[start:end][None], k[start:end][None], v[start:end][None], softmax_scale)[0]
    return out


def _reference_dense(q, k, v, softmax_scale=None, **_):
    """flash-attn's dense kernel in plain torch: causal attention over each whole row of (B, S, H, D)."""
    return _causal(q, k, v, softmax_scale)


def _causal(q, k, v, scale):
    import torch

    groups = q.shape[-2] // k.shape[-2]  # grouped-query attention: flash-attn repeats KV heads itself
    k, v = (t.repeat_interleave(groups, dim=-2) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    )
    return out.transpose(1, 2)


@contextlib.contextmanager
def recording_flash_branches(real: bool, taken: list[str]):
    """transformers' `_flash_attention_forward` with its kernels recorded (`varlen` or `dense`); with `real` False,
    reference kernels stand in for flash-attn's."""
    from transformers import modeling_flash_attention_utils as fa

    original = fa.lazy_import_flash_attention

    def record(name, kernel):
        def call(*args, **kwargs):
            taken.append(name)
            return kernel(*args, **kwargs)

        return call

    def patched(implementation, *args, **kwargs):
        if real:
            (dense, varlen, kvcache, pad, unpad), processors = original(implementation, *args, **kwargs)
        else:
            dense, varlen, kvcache, pad, unpad, processors = (
                _reference_dense,
                _reference_varlen,
                None,
                None,
                None,
                (
                    dict,
                    dict,
                ),
            )
        return (record("dense", dense), record("varlen", varlen), kvcache, pad, unpad), processors

    fa.lazy_import_flash_attention = patched
    try:
        yield
    finally:
        fa.lazy_import_flash_attention = original


def _register_probe() -> None:
    """An attention implementation that is transformers' flash-attention one, under a name that needs no flash-attn
    at model construction."""
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(PROBE_NAME, flash_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE_NAME, flash_attention_mask)


@contextlib.contextmanager
def recording_torch_varlen_branches(taken: list[str]):
    """torch_varlen's branches recorded as its function takes them (`varlen` or `sdpa`), in the order of the calls."""
    from recipes.training import torch_varlen

    original = torch_varlen.branch

    def record(*args, **kwargs):
        taken.append(original(*args, **kwargs))
        return taken[-1]

    torch_varlen.branch = record
    try:
        yield
    finally:
        torch_varlen.branch = original


def build_model(config, *, device: str, dtype_name: str, num_layers: int | None, vocab_size: int | None,
                seed: int) -> tuple[Any, bool, str]:  # fmt: skip
    """(model, whether flash-attn's own kernels run, kernel name). `flash_attention_2` without flash-attn is built
    under the probe's name: transformers' flash-attention code with reference kernels."""
    import torch
    from transformers import AutoModelForCausalLM

    from recipes.architecture import llama_parameter_count
    from recipes.training.model import detect_attn_implementation, llama_config

    model_config = llama_config(config, vocab_size or _tokenizer_facts(config)[1])
    if num_layers:
        model_config.num_hidden_layers = num_layers
    params, _ = llama_parameter_count(**model_config.to_dict())
    if params > MAX_PARAMETERS:
        raise ConfigError(
            f"the model has {params / 1e9:.1f}B parameters: the check builds it whole on one device; "
            "pass --num-layers 2 (attention is the same in every layer)"
        )
    requested = config.attn_implementation
    real_flash = requested == "flash_attention_2" and detect_attn_implementation(requested)[0] == requested
    if requested == "flash_attention_2" and not real_flash:
        _register_probe()
        build_as, kernel = PROBE_NAME, "reference"
    elif requested == "torch_varlen":
        chosen, reason = detect_attn_implementation(requested)  # registers it where its kernel runs
        if chosen != requested:
            raise ConfigError(f"attn_implementation torch_varlen cannot be checked here: {reason}")
        build_as, kernel = requested, "torch varlen_attn"
    else:
        build_as, kernel = requested, "flash-attn" if real_flash else requested
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        model_config, attn_implementation=build_as, dtype=getattr(torch, dtype_name)
    )
    return model.to(device).eval(), real_flash, kernel


def packed_against_alone(model, batch, inputs: dict[str, Any], eos_id: int) -> tuple[float, int]:
    """(largest |packed logit - alone logit|, documents compared)."""
    import torch

    with torch.no_grad():
        packed_logits = model(input_ids=batch, **inputs).logits.float()
        max_abs_diff, documents = 0.0, 0
        for row_index, row in enumerate(batch):
            for start, end in document_spans(row, eos_id):
                alone = model(input_ids=row[start:end][None]).logits.float()[0]
                difference = (packed_logits[row_index, start:end] - alone).abs().max().item()
                max_abs_diff, documents = max(max_abs_diff, difference), documents + 1
    return max_abs_diff, documents


def run_check(config, *, device: str, dtype_name: str, num_layers: int | None = None, vocab_size: int | None = None,
              seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """The JSON object the CLI prints."""
    from transformers.masking_utils import find_packed_sequence_indices

    from recipes.training.attention import DocumentMasking

    requested, eos_id = config.attn_implementation, _tokenizer_facts(config)[0]
    model, real_flash, kernel = build_model(config, device=device, dtype_name=dtype_name, num_layers=num_layers,
                                            vocab_size=vocab_size, seed=seed)  # fmt: skip
    masking = DocumentMasking.of(config.document_masking, eos_id, requested)
    rows, seq_len = config.per_device_train_batch_size, config.max_seq_length
    batch = packed_batch(rows, seq_len, model.config.vocab_size, eos_id).to(device)
    inputs = masking.inputs(batch)
    taken: list[str] = []
    with recording_flash_branches(real_flash, taken), recording_torch_varlen_branches(taken):
        max_abs_diff, documents = packed_against_alone(model, batch, inputs, eos_id)
    if requested in ("flash_attention_2", "torch_varlen"):
        path = "varlen" if taken[:1] == ["varlen"] else "none"
    else:
        position_ids = inputs.get("position_ids")
        packed = position_ids is not None and find_packed_sequence_indices(position_ids) is not None
        path = "block_mask" if packed else "none"
    tolerance = TOLERANCE.get(dtype_name, TOLERANCE["bfloat16"])
    return {
        "attn_implementation": requested, "micro_batch": rows, "seq_len": seq_len,
        "document_masking": config.document_masking, "path": path, "expected_path": masking.path, "kernel": kernel,
        "device": device, "dtype": dtype_name, "documents": documents, "max_abs_diff": max_abs_diff,
        "tolerance": tolerance,
        "ok": path == masking.path and (max_abs_diff <= tolerance or not config.document_masking),
    }  # fmt: skip


def _tokenizer_facts(config) -> tuple[int, int | None]:
    """(EOS id, vocabulary size) of the recipe's tokenizer when it is a local directory; (0, None) otherwise (the
    model's vocabulary then comes from model_config, or `--vocab-size`)."""
    if Path(config.tokenizer_name_or_path).is_dir():
        from data_prep.tokenizer_dir import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer_name_or_path, "tokenizer_name_or_path")
        return tokenizer.eos_token_id, len(tokenizer)
    return 0, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--num-layers", type=int, help="build this many decoder layers instead of the recipe's")
    parser.add_argument("--vocab-size", type=int, help="when neither model_config nor a local tokenizer gives one")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    args, overrides = parser.parse_known_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    try:
        config = load_config(args.config, overrides)
        vocab_given = config.model_config.get("vocab_size") is not None or args.vocab_size is not None
        if not vocab_given and not Path(config.tokenizer_name_or_path).is_dir():
            raise ConfigError(
                f"tokenizer_name_or_path {config.tokenizer_name_or_path} is not a local directory: "
                "pass --vocab-size N (or set model_config.vocab_size)"
            )
        result = run_check(config, device=device, dtype_name=dtype, num_layers=args.num_layers,
                           vocab_size=args.vocab_size)  # fmt: skip
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Check that a recipe's packed batches keep documents apart on its attention path.

    python -m recipes.attention_check --config recipes/configs/tiny_cpu.yaml [--attn_implementation IMPL]
        [--num-layers N] [--dtype float32|bfloat16] [--key value ...]

Builds the recipe's model (any depth with `--num-layers`: attention is the same in every layer) and one micro-batch
of `per_device_train_batch_size` rows of `max_seq_length` tokens, packed from random documents the way training
packs them (`data_prep.packing.rows`), with the model inputs training gives it (`recipes.training.attention`). Runs it,
runs every document alone, and prints one JSON line: `attn_implementation`, `micro_batch`, `document_masking`,
`checks`, `path` (`varlen`, `block_mask` or `none`: the branch transformers took), `kernel`, `max_abs_diff` between
the packed logits and each document's own, and `ok`. With `document_masking: true` the check is that documents are
kept apart (the difference within `tolerance`); with it false, that they do see each other (the difference above it,
as the recipe then trains), and a line on stderr says that nothing is masked. Exit code 0 when ok; 2 for bad input
(one line) and when the check fails (the JSON, then an `error:` line naming what failed): either way a person must
change the recipe or the environment, and the same command fails the same way until then (docs/run-safety.md).
Progress goes to stderr.

On a CPU, a model wider than 1024 is checked *narrowed* (`width` in the JSON): the same head size, query heads per
key-value head, rows, sequence length, attention implementation and inputs, with fewer heads (so a 70B layer's 64
query and 8 key-value heads become 8 and 1) and the MLP shrunk alike. Documents can meet only in attention, which
works per head, so the verdict is the full model's; the 70B check then takes seconds instead of an hour on two cores.
`--full-width` checks the recipe's own width (the default on a GPU).

`flash_attention_2` needs flash-attn and a GPU. Without them the model runs through transformers' own flash-attention
entry points (`flash_attention_forward`, `_flash_attention_forward`, which choose the branch) with a reference
kernel in place of flash-attn's (`kernel: reference`): the branch is transformers' decision on the recipe's inputs,
and the difference is the reference kernel's.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.exit_codes import BAD_INPUT, DONE, OneLineParser, fail
from recipes.config import ConfigError, load_config

NARROW_HIDDEN = 1024  # on a CPU, wider models are checked with fewer heads (see the module docstring)
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # bf16 logits of one kernel over two shapes differ in the 2nd digit
MAX_PARAMETERS = 3e9  # beyond this, shrink with --num-layers: the check needs the whole model on one device
PROBE_NAME = "recipe_varlen_probe"  # a name with "flash" in it would make transformers look for flash-attn


def packed_batch(rows: int, seq_len: int, vocab_size: int, eos_id: int, seed: int = 0):
    """`rows` packed rows of `seq_len` ids from random documents (mean length seq_len / 3), EOS after each."""
    import torch

    from data_prep.packing.rows import pack_documents

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


def narrow(model_config) -> str:
    """Narrow `model_config` in place to one key-value head (see the module docstring); returns what the JSON says."""
    heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    per_kv = heads // kv_heads
    if per_kv * head_dim >= model_config.hidden_size:
        return "full"
    said = (f"narrowed: {per_kv} of {heads} query heads and 1 of {kv_heads} key-value heads, head size {head_dim}, "
            f"hidden {per_kv * head_dim} of {model_config.hidden_size}")  # fmt: skip
    scale = per_kv * head_dim / model_config.hidden_size
    model_config.head_dim = head_dim
    model_config.num_attention_heads, model_config.num_key_value_heads = per_kv, 1
    model_config.hidden_size = per_kv * head_dim
    model_config.intermediate_size = max(1, round(model_config.intermediate_size * scale))
    return said


def build_model(config, *, device: str, dtype_name: str, num_layers: int | None, vocab_size: int | None,
                seed: int, full_width: bool = False) -> tuple[Any, bool, str, str]:  # fmt: skip
    """(model, whether flash-attn's own kernels run, kernel name, width). `flash_attention_2` without flash-attn is
    built under the probe's name: transformers' flash-attention code with reference kernels."""
    import torch
    from transformers import AutoModelForCausalLM

    from recipes.architecture import llama_parameter_count
    from recipes.training.model import detect_attn_implementation, llama_config

    model_config = llama_config(config, vocab_size or _tokenizer_facts(config)[1])
    if num_layers:
        model_config.num_hidden_layers = num_layers
    width = "full"
    if device == "cpu" and not full_width and model_config.hidden_size > NARROW_HIDDEN:
        width = narrow(model_config)
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
    progress(f"building the model: {model_config.num_hidden_layers} layer(s), {params / 1e6:,.0f}M parameters "
             f"({width}), {kernel} kernels, on {device}")  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        model_config, attn_implementation=build_as, dtype=getattr(torch, dtype_name)
    )
    return model.to(device).eval(), real_flash, kernel, width


def progress(line: str) -> None:
    print(f"attention_check: {line}", file=sys.stderr, flush=True)


def packed_against_alone(model, batch, inputs: dict[str, Any], eos_id: int) -> tuple[float, int]:
    """(largest |packed logit - alone logit|, documents compared)."""
    import torch

    spans = [(row_index, span) for row_index, row in enumerate(batch) for span in document_spans(row, eos_id)]
    with torch.no_grad():
        progress(f"the packed batch: {batch.shape[0]} row(s) of {batch.shape[1]} tokens, {len(spans)} documents")
        packed_logits = model(input_ids=batch, **inputs).logits.float()
        max_abs_diff = 0.0
        for done, (row_index, (start, end)) in enumerate(spans, 1):
            alone = model(input_ids=batch[row_index, start:end][None]).logits.float()[0]
            difference = (packed_logits[row_index, start:end] - alone).abs().max().item()
            max_abs_diff = max(max_abs_diff, difference)
            if done % 10 == 0 or done == len(spans):
                progress(f"{done} of {len(spans)} documents alone")
    return max_abs_diff, len(spans)


def run_check(config, *, device: str, dtype_name: str, num_layers: int | None = None, vocab_size: int | None = None,
              seed: int = 0, full_width: bool = False) -> dict[str, Any]:  # fmt: skip
    """The JSON object the CLI prints."""
    from transformers.masking_utils import find_packed_sequence_indices

    from recipes.training.attention import DocumentMasking

    requested, eos_id = config.attn_implementation, _tokenizer_facts(config)[0]
    model, real_flash, kernel, width = build_model(
        config, device=device, dtype_name=dtype_name, num_layers=num_layers, vocab_size=vocab_size, seed=seed,
        full_width=full_width,
    )  # fmt: skip
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
    # Unmasked, the check is the opposite one: the recipe trains with documents seeing each other, so they must.
    apart = max_abs_diff <= tolerance if config.document_masking else max_abs_diff > tolerance
    return {
        "attn_implementation": requested, "micro_batch": rows, "seq_len": seq_len,
        "document_masking": config.document_masking,
        "checks": "documents kept apart" if config.document_masking else "documents see each other (no masking)",
        "path": path, "expected_path": masking.path, "kernel": kernel, "width": width, "device": device,
        "dtype": dtype_name, "documents": documents, "max_abs_diff": max_abs_diff, "tolerance": tolerance,
        "ok": path == masking.path and apart,
    }  # fmt: skip


def _tokenizer_facts(config) -> tuple[int, int | None]:
    """(EOS id, vocabulary size) of the recipe's tokenizer when it is a local directory; (0, None) otherwise (the
    model's vocabulary then comes from model_config, or `--vocab-size`)."""
    if Path(config.tokenizer_name_or_path).is_dir():
        from data_prep.tokenizer.loading import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer_name_or_path, "tokenizer_name_or_path")
        return tokenizer.eos_token_id, len(tokenizer)
    return 0, None


def check_arguments(num_layers: int | None, vocab_size: int | None, device: str) -> None:
    """The flags that argparse's types cannot judge, each refused in one line."""
    import torch

    if num_layers is not None and num_layers < 1:
        raise ConfigError(f"--num-layers {num_layers}: give 1 or more layers (leave it out for the recipe's)")
    if vocab_size is not None and vocab_size < 2:
        raise ConfigError(f"--vocab-size {vocab_size}: give the tokenizer's vocabulary size, 2 or more")
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ConfigError(f"--device {device}: choose cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: torch sees no CUDA device here; run it on a GPU node, or --device cpu")
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: this node has {torch.cuda.device_count()} CUDA device(s)")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--num-layers", type=int, help="build this many decoder layers instead of the recipe's")
    parser.add_argument("--vocab-size", type=int, help="when neither model_config nor a local tokenizer gives one")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--device", help="cpu, cuda or cuda:N; default: cuda when available, else cpu")
    parser.add_argument("--full-width", action="store_true", help="on a CPU, check the recipe's own width too")
    args, overrides = parser.parse_known_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    try:
        check_arguments(args.num_layers, args.vocab_size, device)
        config = load_config(args.config, overrides)
        vocab_given = config.model_config.get("vocab_size") is not None or args.vocab_size is not None
        if not vocab_given and not Path(config.tokenizer_name_or_path).is_dir():
            raise ConfigError(
                f"tokenizer_name_or_path {config.tokenizer_name_or_path} is not a local directory: "
                "pass --vocab-size N (or set model_config.vocab_size)"
            )
        if not config.document_masking:
            progress("document_masking is false: this checks that packed documents DO see each other, as this "
                     "recipe trains; --document_masking true checks that they are kept apart")  # fmt: skip
        result = run_check(config, device=device, dtype_name=dtype, num_layers=args.num_layers,
                           vocab_size=args.vocab_size, full_width=args.full_width)  # fmt: skip
    except (ConfigError, ValueError) as error:
        return fail(str(error), BAD_INPUT)
    print(json.dumps(result))
    return DONE if result["ok"] else fail(verdict(args.config, result), BAD_INPUT)


def verdict(config: str, result: dict[str, Any]) -> str:
    """The one line of a failed check: what was expected, what was found, and which keys decide it."""
    masking = "true" if result["document_masking"] else "false"
    return (f"--config {config}: the check failed: {result['checks']} was expected, but transformers took path "
            f"{result['path']} (expected {result['expected_path']}) and max_abs_diff is {result['max_abs_diff']:.3g} "
            f"(tolerance {result['tolerance']:g}): attn_implementation {result['attn_implementation']} with "
            f"document_masking {masking} does not train as the recipe says here; choose another attn_implementation "
            "or transformers version (docs/training.md, document masking)")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())

"""Document masking on every attention path: the inputs the recipe gives the model, the branch transformers takes
with them, and packed documents against each document alone (recipes.training.attention, recipes.attention_check)."""

import json

import pytest
import torch

from recipes.attention_check import document_spans, main, packed_batch, run_check
from recipes.config import ATTN_IMPLEMENTATIONS, load_config
from recipes.training import attention
from tests.conftest import REPO, TINY_RECIPE

TINY = ["--model_config.vocab_size", "512", "--model_config.num_hidden_layers", "2", "--max_seq_length", "96"]


def check(implementation: str, micro_batch: int, masking: bool = True) -> dict:
    config = load_config(TINY_RECIPE, [*TINY, "--attn_implementation", implementation, "--per_device_train_batch_size",
                                       str(micro_batch), "--document_masking", str(masking).lower()])  # fmt: skip
    return run_check(config, device="cpu", dtype_name="float32")


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flash_attention_2"])
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_packed_documents_equal_each_document_alone_on_every_path(implementation, micro_batch):
    result = check(implementation, micro_batch)
    expected = "varlen" if implementation == "flash_attention_2" else "block_mask"
    assert result["path"] == expected == result["expected_path"]
    assert result["documents"] > micro_batch, "the batch must hold several documents per row to mean anything"
    assert result["max_abs_diff"] <= 1e-4 and result["ok"]


def test_flash_attention_takes_the_varlen_branch_only_because_the_recipe_passes_cumulative_lengths(monkeypatch):
    """Negative control: position ids alone (what the recipe passed before) reach transformers' varlen branch for one
    row only; at micro-batch 2 its dense kernel runs, and documents attend to each other."""
    assert check("flash_attention_2", 2)["path"] == "varlen"
    original = attention.document_inputs

    def position_ids_only(input_ids, eos_id, implementation):
        return {"position_ids": original(input_ids, eos_id, implementation)["position_ids"]}

    monkeypatch.setattr(attention, "document_inputs", position_ids_only)
    assert check("flash_attention_2", 1)["path"] == "varlen"
    leaking = check("flash_attention_2", 2)
    assert leaking["path"] == "none" and not leaking["ok"] and leaking["max_abs_diff"] > 1e-2


def test_without_document_masking_documents_see_each_other():
    result = check("sdpa", 2, masking=False)
    assert result["path"] == result["expected_path"] == "none"
    assert result["max_abs_diff"] > 1e-2
    assert result["checks"] == "documents see each other (no masking)" and result["ok"]


def test_unmasked_the_check_fails_when_documents_do_not_see_each_other(monkeypatch):
    """It used to print ok: true for any difference when masking was off: a check that could not fail."""
    import recipes.attention_check as attention_check

    monkeypatch.setattr(attention_check, "packed_against_alone", lambda *args: (0.0, 5))
    assert not check("sdpa", 2, masking=False)["ok"]
    assert check("sdpa", 2, masking=True)["ok"]


def test_the_70b_recipe_is_checked_masked_and_narrowed_on_a_cpu_in_seconds(capsys, corpus):
    """README step 3, literally, on a CPU: the shipped 70B recipes mask documents, and the check builds them with
    the recipe's head size and heads per key-value head (it ran over 5 minutes, silently, and checked nothing)."""
    for recipe in ("llama70b_a800x8.yaml", "llama70b_a800x16.yaml"):
        assert load_config(REPO / "recipes/configs" / recipe, []).document_masking
    argv = ["--config", str(REPO / "recipes/configs/llama70b_a800x8.yaml"), "--num-layers", "2",
            "--tokenizer_name_or_path", str(corpus["tokenizer"])]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip())
    assert result["checks"] == "documents kept apart" and result["path"] == "varlen" and result["ok"]
    assert result["width"].startswith("narrowed: 8 of 64 query heads and 1 of 8 key-value heads, head size 128")
    assert result["seq_len"] == 2048 and result["micro_batch"] == 2 and result["documents"] > 2
    assert "documents alone" in captured.err and "building the model: 2 layer(s)" in captured.err
    leaking = main([*argv, "--document_masking", "false"])  # the narrowed model still shows documents meeting
    assert leaking == 0 and json.loads(capsys.readouterr().out.strip())["max_abs_diff"] > 1e-2


@pytest.mark.parametrize(
    "flags, named",
    [(["--num-layers", "0"], "--num-layers 0"), (["--num-layers", "-2"], "--num-layers -2"),
     (["--vocab-size", "0"], "--vocab-size 0"), (["--vocab-size", "-5"], "--vocab-size -5"),
     (["--device", "banana"], "--device banana"), (["--device", "cuda"], "--device cuda")],
)  # fmt: skip
def test_impossible_flags_are_one_line_each(capsys, flags, named):
    if "cuda" in flags and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["--config", str(TINY_RECIPE), *TINY, *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"error: {named}") and "\n" not in error


def test_varlen_inputs_mark_every_row_start_and_every_document_start():
    eos = 0
    input_ids = torch.tensor([[5, 6, eos, 7, 8, 9], [4, eos, eos, 3, 2, 1]])
    inputs = attention.document_inputs(input_ids, eos, "flash_attention_2")
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 6, 8, 9, 12]
    assert inputs["cu_seq_lens_q"] is inputs["cu_seq_lens_k"] or inputs["cu_seq_lens_k"].tolist() == [0, 3, 6, 8, 9, 12]
    assert inputs["max_length_q"] == inputs["max_length_k"] == 3 and isinstance(inputs["max_length_q"], int)
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 0, 1, 2]]
    assert attention.document_inputs(input_ids, eos, "sdpa").keys() == {"position_ids"}
    assert attention.document_inputs(input_ids, None, "flash_attention_2") == {}


def test_spans_are_what_training_calls_a_document():
    row = torch.tensor([1, 2, 0, 3, 0, 4, 5])
    assert document_spans(row, 0) == [(0, 3), (3, 5), (5, 7)]
    batch = packed_batch(3, 64, 100, eos_id=0)
    assert batch.shape == (3, 64) and (batch == 0).any()


def test_the_start_line_names_the_path_and_an_implementation_without_one_is_refused():
    assert (
        attention.describe("flash_attention_2", True) == "attention: flash_attention_2, document masking: on (varlen)"
    )
    assert attention.describe("sdpa", True) == "attention: sdpa, document masking: on (block_mask)"
    assert attention.describe("eager", False) == "attention: eager, document masking: off"
    assert set(ATTN_IMPLEMENTATIONS) == set(attention.MASKING_PATHS)
    assert attention.describe("flex_attention", True) == "attention: flex_attention, document masking: on (block_mask)"
    assert attention.describe("torch_varlen", True) == "attention: torch_varlen, document masking: on (varlen)"
    with pytest.raises(ValueError, match="paged_attention.*no packed path"):
        attention.describe("paged_attention", True)
    assert attention.describe("paged_attention", False).endswith("off")


def test_the_check_prints_one_json_line_and_refuses_bad_input_in_one_line(capsys, tmp_path):
    assert main(["--config", str(TINY_RECIPE), *TINY, "--per_device_train_batch_size", "2",
                 "--document_masking", "true"]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip())
    assert result["micro_batch"] == 2 and result["path"] == "block_mask" and result["ok"]
    assert main(["--config", str(TINY_RECIPE), "--attn_implementation", "flash"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: attn_implementation 'flash'") and "\n" not in error
    no_tokenizer = ["--tokenizer_name_or_path", str(tmp_path / "no_tokenizer")]
    assert main(["--config", str(TINY_RECIPE), "--max_seq_length", "64", *no_tokenizer]) == 2  # no vocabulary anywhere
    assert "--vocab-size" in capsys.readouterr().err
    huge = ["--model_config.hidden_size", "8192", "--model_config.num_hidden_layers", "80",
            "--model_config.intermediate_size", "28672", "--model_config.num_attention_heads", "64"]  # fmt: skip
    assert main(["--config", str(TINY_RECIPE), "--vocab-size", "32000", *huge]) == 2
    assert "--num-layers" in capsys.readouterr().err


def test_torch_varlen_tells_the_kernel_of_grouped_heads_only_where_it_has_the_argument():
    """The GPU machines run torch 2.11, whose varlen_attn has no `enable_gqa` (a TypeError at the first forward
    there); torch 2.13 needs it for fewer key/value heads than query heads."""
    from recipes.training.torch_varlen import gqa_keyword

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)):  # fmt: skip
        return query

    def torch_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                   enable_gqa=False):  # fmt: skip
        return query

    assert gqa_keyword(torch_2_11, True) == {} and gqa_keyword(torch_2_13, True) == {"enable_gqa": True}
    assert gqa_keyword(torch_2_13, False) == {"enable_gqa": False}

"""In-loop benchmarks split over ranks (eval.sharded): two ranks score every document as one rank does, with the
same prompts, and pad their forward passes to equal counts."""

import json

import pytest

from eval import fixtures
from tests.conftest import REPO, TINY_RECIPE, launch

pytestmark = pytest.mark.multiprocess


def samples_of(directory) -> dict:
    records = [json.loads(line) for line in (directory / "eval" / "step-0-samples.jsonl").read_text().splitlines()]
    return {(r["task"], r["doc_id"], r["filter"]): r for r in records}


def test_two_ranks_score_every_document_as_one_rank(tmp_path, trained_run):
    data = fixtures.write(tmp_path / "eval_data")
    model = trained_run["dir"] / "final"
    runs = {}
    for ranks in (1, 2):
        output = tmp_path / f"ranks{ranks}"
        overrides = [
            "--model_name_or_path",
            str(model),
            "--model_config",
            "{}",
            "--tokenizer_name_or_path",
            str(model),
            "--output_dir",
            str(output / "run"),
            "--global_batch_size",
            "null",
            "--bf16",
            "false",
        ]
        result = launch(REPO / "tests/scripts/eval_in_loop.py",
                        [str(TINY_RECIPE), str(output), str(data["mmlu_csv"]), str(data["gsm8k_jsonl"]), *overrides],
                        num_processes=ranks)  # fmt: skip
        assert result.returncode == 0, result.stderr[-4000:]
        runs[ranks] = output
    one, two = samples_of(runs[1]), samples_of(runs[2])
    assert one.keys() == two.keys() and len({key[:2] for key in one}) == 2 * 5 + 5  # 2 MMLU subjects and GSM8K, 5 each
    for key, record in one.items():
        other = two[key]
        assert record["arguments"] == other["arguments"], f"{key}: the prompts differ"
        if key[0].startswith("gsm8k"):
            assert record["filtered_resps"] == other["filtered_resps"], key
        else:
            # each request's first response (lm-eval appends its padding copies' responses after it)
            ours = [responses[0][0] for responses in record["resps"]]
            theirs = [responses[0][0] for responses in other["resps"]]
            assert ours == pytest.approx(theirs, abs=1e-4), key
    # the prompts' lengths, counted by each rank over its share, add up to one rank's
    lengths = [json.loads((runs[n] / "eval" / "step-0.json").read_text())["prompt_lengths"] for n in (1, 2)]
    for key in ("truncated", "longest_tokens", "most_over", "max_length"):
        assert lengths[0][key] == lengths[1][key], key
    assert lengths[1]["prompts"] >= lengths[0]["prompts"] > 0  # lm-eval pads a rank's requests with copies
    scores = {n: json.loads((runs[n] / "rank-0.json").read_text())["scores"] for n in (1, 2)}
    for metric in ("mmlu/acc", "gsm8k/exact_match_strict", "gsm8k/exact_match_flexible"):
        assert scores[1][metric] == pytest.approx(scores[2][metric])
    # rank 0 holds 3 documents of each task, rank 1 holds 2: one more MMLU batch of 2 on rank 0, which rank 1 matches
    # with one dummy forward; GSM8K's padded request keeps both at 2 generate calls
    dummies = [json.loads((runs[2] / f"rank-{rank}.json").read_text())["dummy"] for rank in (0, 1)]
    assert dummies == [0, 1]

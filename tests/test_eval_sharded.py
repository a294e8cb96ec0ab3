"""In-loop benchmarks split over ranks (eval.sharded): two ranks score every document as one rank does, with the
same prompts, and pad their forward passes to equal counts."""

import json
from pathlib import Path

import pytest

from eval import fixtures
from tests.conftest import LAUNCH_ENV, REPO, TINY_RECIPE, launch
from tests.gloo_ranks import on_ranks

pytestmark = pytest.mark.multiprocess


def samples_of(directory) -> dict:
    records = [json.loads(line) for line in (directory / "eval" / "step-0-samples.jsonl").read_text().splitlines()]
    return {(r["task"], r["doc_id"], r["filter"]): r for r in records}


def evaluate_on(ranks: int, output, model, data, limit: int = 5, timeout_s: int = 600, fail_on_rank=None):
    overrides = ["--model_name_or_path", str(model), "--model_config", "{}", "--tokenizer_name_or_path", str(model),
                 "--output_dir", str(output / "run"), "--global_batch_size", "null", "--bf16", "false"]  # fmt: skip
    result = launch(REPO / "tests/scripts/eval_in_loop.py",
                    [str(TINY_RECIPE), str(output), str(data["mmlu_csv"]), str(data["gsm8k_jsonl"]), *overrides],
                    num_processes=ranks, timeout_s=timeout_s, env={**LAUNCH_ENV, "EVAL_LIMIT": str(limit),
                    **({"EVAL_FAIL_ON_RANK": str(fail_on_rank)} if fail_on_rank is not None else {})})  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    (output / "stderr.txt").write_text(result.stderr)
    return output


def test_two_ranks_score_every_document_as_one_rank(tmp_path, trained_run):
    data = fixtures.write(tmp_path / "eval_data")
    model = trained_run["dir"] / "final"
    runs = {ranks: evaluate_on(ranks, tmp_path / f"ranks{ranks}", model, data) for ranks in (1, 2)}
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


def test_tasks_with_fewer_documents_than_ranks_are_scored_and_nothing_hangs(tmp_path, trained_run):
    """Issue 37: split over 2 ranks, an MMLU subject with one test document hung the in-loop benchmarks (the rank with
    no document stopped in lm-eval's `task.instances[0]` while rank 0 waited in the gather of scores, 8 minutes, then
    the watchdog). Now the rank with none scores a stand-in and sends nothing for it: a subject of 1 document and
    `eval_limit 1` give one rank's scores and records, in seconds."""
    data = fixtures.write(tmp_path / "eval_data", test_per_subject=4, gsm8k_test=4)
    subject = data["mmlu_csv"] / "test" / f"{fixtures.SUBJECTS[0]}_test.csv"
    subject.write_text(subject.read_text().splitlines(keepends=True)[0])  # one test document
    model = trained_run["dir"] / "final"
    runs = {ranks: evaluate_on(ranks, tmp_path / f"ranks{ranks}", model, data, limit=1, timeout_s=300)
            for ranks in (1, 2)}  # fmt: skip
    one, two = samples_of(runs[1]), samples_of(runs[2])
    assert one.keys() == two.keys() and {key[:2] for key in one} == {
        (f"mmlu_local_{s}", 0) for s in fixtures.SUBJECTS} | {("gsm8k_local", 0)}, "each document once"  # fmt: skip
    for key, record in one.items():
        assert record["arguments"] == two[key]["arguments"], key
    results = [json.loads((runs[n] / "eval" / "step-0.json").read_text()) for n in (1, 2)]
    assert results[0]["n-samples"] == results[1]["n-samples"]
    assert all(n["effective"] == 1 for n in results[1]["n-samples"].values()), results[1]["n-samples"]
    scores = {n: json.loads((runs[n] / "rank-0.json").read_text())["scores"] for n in (1, 2)}
    assert scores[2] and scores[1]["mmlu/acc"] == pytest.approx(scores[2]["mmlu/acc"])
    assert scores[1]["gsm8k/exact_match_strict"] == pytest.approx(scores[2]["gsm8k/exact_match_strict"])
    stand_ins = [json.loads((runs[2] / f"rank-{rank}.json").read_text())["stand_ins"] for rank in (0, 1)]
    assert stand_ins == [[], sorted([f"mmlu_local_{s}" for s in fixtures.SUBJECTS] + ["gsm8k_local"])]


def test_a_failure_on_one_rank_is_logged_and_every_rank_goes_on(tmp_path, trained_run):
    """Issue 37: a rank whose evaluation raised left the others waiting in lm-eval's next collective until the hang
    watchdog (30 minutes, then a requeue into the same failure). Now it meets their next collective with its failure:
    every rank leaves lm-eval, the failure is logged once with the rank and the error, and the next evaluation (the
    training's collectives too) runs in step."""
    data = fixtures.write(tmp_path / "eval_data", test_per_subject=2, gsm8k_test=2)
    output = evaluate_on(2, tmp_path / "ranks2", trained_run["dir"] / "final", data, limit=2, timeout_s=300,
                         fail_on_rank=1)  # fmt: skip
    ranks = [json.loads((output / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["failed_scores"] for r in ranks] == [{}, {}], "both ranks left the failed evaluation"
    assert "gsm8k/exact_match_strict" in ranks[0]["scores"] and ranks[0]["scores"] == ranks[1]["scores"]
    stderr = (output / "stderr.txt").read_text()
    assert stderr.count("benchmarks failed on rank(s) 1, training continues: ValueError: a document this rank") == 1


def _fail_on_rank_1s_second_request(rank: int, model_dir: str, mmlu_dir: str, workdir: str) -> None:
    """One rank of `test_a_failure_without_a_stop_callback_meets_the_other_rank_at_its_next_forward`."""
    import torch
    import torch.distributed as dist
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.agreement import FailedOnAnotherRank
    from eval.harness import BenchmarkSettings, evaluate

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # a stand-in for ZeRO-3: every forward pass is a collective (its gather of the sharded weights)
    model.register_forward_pre_hook(lambda module, args: dist.all_reduce(torch.ones(4096)))
    select, requests = HFLM._select_cont_toks, [0]

    def failing(self, *args, **kwargs):  # after rank 1's first forward: a document its scoring cannot take
        requests[0] += 1
        if rank == 1 and requests[0] == 2:
            raise RuntimeError("rank 1 cannot take this document")
        return select(self, *args, **kwargs)

    HFLM._select_cont_toks = failing  # this spawned process's own class
    settings = BenchmarkSettings(["mmlu"], mmlu_dir, limit=4, batch_size=1)
    try:
        evaluate(model, tokenizer, settings, rank=rank, world_size=2, stop_requested=None)
        outcome = "finished"
    except FailedOnAnotherRank:
        outcome = "FailedOnAnotherRank"
    except RuntimeError as error:
        outcome = f"RuntimeError: {error}"
    (Path(workdir) / f"rank-{rank}.txt").write_text(outcome)


def test_a_failure_without_a_stop_callback_meets_the_other_rank_at_its_next_forward(tmp_path, corpus):
    """Only with a `stop_requested` did the ranks agree before each forward pass: without one, a rank that failed
    announced it while the other rank was in its next forward's weight gather, a collective of another size (gloo
    aborted the process; NCCL hangs until the watchdog). Now they always agree first: the failed rank raises its
    error, the other leaves with `FailedOnAnotherRank`, and both end cleanly."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
                     ).save_pretrained(tmp_path / "model")  # fmt: skip
    tokenizer.save_pretrained(tmp_path / "model")
    data = fixtures.write(tmp_path / "eval_data", test_per_subject=4, gsm8k_test=2)
    on_ranks(_fail_on_rank_1s_second_request, 2, tmp_path / "ranks", str(tmp_path / "model"), str(data["mmlu_csv"]),
             str(tmp_path), timeout_s=60)  # fmt: skip
    outcomes = [(tmp_path / f"rank-{rank}.txt").read_text() for rank in (0, 1)]
    assert outcomes == ["FailedOnAnotherRank", "RuntimeError: rank 1 cannot take this document"]

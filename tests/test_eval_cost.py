"""The planner's price of in-loop benchmarks (recipes.planning.eval_cost, `eval_*` in the plan) and the timings a
run logs beside it (eval.in_loop.benchmark_timings)."""

import json
import math

import pytest

from eval.in_loop import benchmark_timings
from recipes import planning as planner
from recipes.config import load_config
from recipes.config.deepspeed import load_deepspeed_json
from recipes.planning.eval_cost import GSM8K_TEST_DOCUMENTS, MMLU_TEST_DOCUMENTS, EvalWork, eval_cost, forward_passes
from tests.conftest import REPO

RECIPE_8 = REPO / "recipes/configs/llama70b_a800x8.yaml"


def work(**changes) -> EvalWork:
    values = {"tasks": ("mmlu", "gsm8k"), "limit": None, "num_fewshot": 5, "batch_size": 4, "max_gen_toks": None,
              "ranks_sharing": 1}  # fmt: skip
    return EvalWork(**{**values, **changes})


def test_forward_passes_count_one_per_mmlu_batch_and_one_per_generated_token():
    assert work().documents() == {"mmlu": MMLU_TEST_DOCUMENTS, "gsm8k": GSM8K_TEST_DOCUMENTS}
    passes = forward_passes(work())
    assert passes["mmlu"] == -(-MMLU_TEST_DOCUMENTS // 4)
    assert passes["gsm8k"] == -(-GSM8K_TEST_DOCUMENTS // 4) * (1 + 256)
    limited = forward_passes(work(limit=10, max_gen_toks=32, mmlu_subjects=2))
    assert limited == {"mmlu": 5, "gsm8k": 3 * 33}
    split = forward_passes(work(ranks_sharing=8))
    assert split["mmlu"] == math.ceil(math.ceil(MMLU_TEST_DOCUMENTS / 8) / 4)


def test_seconds_are_gathers_plus_the_longer_of_compute_and_host_work():
    one = work(tasks=("gsm8k",), limit=4, max_gen_toks=9)  # one batch: a prefill and 9 one-token forwards
    cost = eval_cost(one, params=1e9, gather_s=2.0, flops_per_s=1e15, host_s_per_forward=0.1, training_s_between=100)
    prefill = 2e9 * 4 * 160 * 6 / 1e15
    assert cost.forward_passes == 10
    assert cost.seconds == pytest.approx(10 * 2.0 + max(prefill, 0.1) + 9 * max(2e9 * 4 / 1e15, 0.1))
    assert cost.share == pytest.approx(cost.seconds / 100)
    assert cost.seconds_per_document("gsm8k") == pytest.approx(cost.seconds / 4)
    assert eval_cost(one, params=1e9, gather_s=0.0, flops_per_s=1e15, training_s_between=None).share is None


def test_the_plan_prices_the_70b_recipe_and_warns_when_benchmarks_dominate(capsys):
    # at the evaluation batch the recipe used to have (2), every rank scoring every document
    full = load_config(RECIPE_8, ["--per_device_eval_batch_size", "2", "--model_config.vocab_size", "32000"])
    plan = planner.make_plan(full, planner.hardware_from(full), load_deepspeed_json(planner.DEFAULT_DEEPSPEED_JSON))
    assert plan.eval_documents == {"mmlu": MMLU_TEST_DOCUMENTS, "gsm8k": GSM8K_TEST_DOCUMENTS}
    assert plan.eval_share > 0.10 and plan.eval_seconds > 86_400, "a full pass at 70B on PCIe costs a day and more"
    assert any(w.startswith("benchmarks take") and "eval_limit" in w for w in plan.warnings)
    assert planner.main(["--config", str(RECIPE_8), "--per_device_eval_batch_size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eval_forward_passes"] == plan.eval_forward_passes and out["eval_share"] > 0
    assert out["eval_seconds"] == pytest.approx(plan.eval_seconds)
    assert planner.main(["--config", str(RECIPE_8), "--eval_tasks", "[]", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eval_seconds"] is None


def test_run_timings_split_scoring_from_generation():
    results = {
        "n-samples": {"mmlu_local_anatomy": {"effective": 6}, "mmlu_local_virology": {"effective": 4},
                      "gsm8k_local": {"effective": 5}},
        "timings": {"loglikelihood_s": 2.0, "loglikelihood_requests": 40, "generate_until_s": 10.0,
                    "generate_until_requests": 5},
    }  # fmt: skip
    timings = benchmark_timings(results, 13.0)
    assert timings == {"benchmark_seconds": 13.0, "benchmark_seconds_per_document": 13.0 / 15,
                       "mmlu_seconds_per_document": 0.2, "gsm8k_seconds_per_document": 2.0}  # fmt: skip
    assert "gsm8k_seconds_per_document" not in benchmark_timings({**results, "timings": {}}, 13.0)


@pytest.mark.parametrize("name", ["llama70b_a800x8", "llama70b_a800x16"])
def test_the_70b_recipes_evaluate_within_their_budget(name):
    """Full MMLU and GSM8K at every evaluation, split over the ranks, at an evaluation batch that fits: about 5 % of the
    training time between evaluations, as the recipes' comments say (4.4 % on 16 GPUs; 5.7 % on 8, where a decoder
    layer gathered whole and the next one prefetched leave room for 23 rows, not 27)."""
    config = load_config(REPO / f"recipes/configs/{name}.yaml", ["--model_config.vocab_size", "32000"])
    plan = planner.make_plan(config, planner.hardware_from(config), load_deepspeed_json(planner.DEFAULT_DEEPSPEED_JSON))
    assert config.eval_limit is None and config.eval_tasks == ["mmlu", "gsm8k"]
    assert plan.eval_share <= 0.06
    assert config.per_device_eval_batch_size <= plan.eval_batch_fits
    header = (REPO / f"recipes/configs/{name}.yaml").read_text()
    assert f"{plan.eval_share:.1%}".replace("%", " %") in header, "the header's share is the plan's"
    assert f"{plan.eval_forward_passes:,} forward passes per rank" in header
    assert f"{plan.eval_batch_fits} rows fit" in header


def test_an_eval_limit_below_the_number_of_ranks_is_accepted_and_priced_at_one_document_per_rank():
    """Refused while a rank without a document hung the benchmarks; now such a rank scores a stand-in (eval.sharded),
    which costs what one document costs."""
    from recipes.config import validate_for_world

    validate_for_world(load_config(RECIPE_8, ["--eval_limit", "4", "--global_batch_size", "null"]), 8)
    # 57 subjects of 4 documents over 8 ranks: each rank scores one of every subject (4 of them stand-ins)
    assert forward_passes(work(tasks=("mmlu",), limit=4, ranks_sharing=8))["mmlu"] == math.ceil(57 / 4)
    assert forward_passes(work(tasks=("gsm8k",), limit=4, ranks_sharing=8, max_gen_toks=9))["gsm8k"] == 1 * 10

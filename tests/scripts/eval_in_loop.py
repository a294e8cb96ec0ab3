"""Launched by tests/test_eval_sharded.py on 1 and on 2 CPU processes: the in-loop benchmarks on a trained model loaded
into the recipe's ZeRO-3 engine (partitioned as it loads), with every document's record kept. Rank 0 writes
lm-eval's results and samples under OUTPUT/eval/, and every rank writes how many dummy forwards it ran and the tasks
it scored a stand-in document of. EVAL_LIMIT: documents per task (5). EVAL_FAIL_ON_RANK: that rank's scoring fails in
a first evaluation (the scores of which every rank writes as `failed_scores`), before the usual one."""

import json
import os
import sys
from pathlib import Path

import torch

from eval import sharded
from eval.harness import BenchmarkSettings
from eval.in_loop import run_benchmarks
from recipes.config import load_config
from recipes.training.model import build_engine, llama_config
from recipes.training.startup import setup_distributed


def main(recipe: str, output: str, mmlu_dir: str, gsm8k_dir: str, overrides: list[str]) -> None:
    config = load_config(recipe, overrides)
    accelerator, ds_config = setup_distributed(config)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model_name_or_path)
    engine, _, _ = build_engine(config, llama_config(config, len(tokenizer)), "sdpa", ds_config, accelerator, False)
    settings = BenchmarkSettings(tasks=["mmlu", "gsm8k"], mmlu_dir=mmlu_dir, gsm8k_dir=gsm8k_dir,
                                 limit=int(os.environ.get("EVAL_LIMIT", "5")),
                                 batch_size=2, max_gen_toks=10, log_samples=True)  # fmt: skip
    counted = []
    original = sharded.sharded_lm_class

    def counting(base):  # record each rank's padding forwards
        cls = original(base)

        class Counting(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                counted.append(self)

        return Counting

    sharded.sharded_lm_class = counting
    failed_scores = None
    if os.environ.get("EVAL_FAIL_ON_RANK") == str(accelerator.process_index):
        failed_scores = fail_once_on_this_rank(engine, accelerator, tokenizer, settings, output)
    elif os.environ.get("EVAL_FAIL_ON_RANK"):
        failed_scores = run_benchmarks(engine, accelerator, tokenizer, settings, step=0, output_dir=Path(output))
    scores = run_benchmarks(engine, accelerator, tokenizer, settings, step=0, output_dir=Path(output))
    dummies = counted[0].dummy_forwards if counted else 0
    stand_ins = sorted(counted[0].stand_in_tasks) if counted else []
    Path(output, f"rank-{accelerator.process_index}.json").write_text(
        json.dumps({"scores": scores, "dummy": dummies, "stand_ins": stand_ins, "failed_scores": failed_scores})
    )
    torch.distributed.barrier()
    accelerator.end_training()


def fail_once_on_this_rank(engine, accelerator, tokenizer, settings, output):
    """EVAL_FAIL_ON_RANK: this rank's GSM8K scoring raises (after every forward pass, before lm-eval gathers the
    scores), as a document a filter cannot take would; the others are then inside lm-eval's next collective."""
    from lm_eval.api.task import ConfigurableTask

    original = ConfigurableTask.process_results

    def failing(self, doc, results):
        if self.config.task.startswith("gsm8k"):
            raise ValueError("a document this rank cannot score")
        return original(self, doc, results)

    ConfigurableTask.process_results = failing
    try:
        return run_benchmarks(engine, accelerator, tokenizer, settings, step=0, output_dir=Path(output))
    finally:
        ConfigurableTask.process_results = original


if __name__ == "__main__":
    from common.process import run_as_rank

    run_as_rank(lambda: main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]))

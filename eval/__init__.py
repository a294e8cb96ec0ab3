"""MMLU and GSM8K through lm-eval: lm-eval's own tasks on the offline layouts that `data_prep.benchmark_files.layouts`
reads (`eval.harness`, with lm-eval's HF model as `eval.timed_lm` runs it), the standalone runner
(`python -m eval.run`), the in-loop hook (`eval.in_loop`), and generated fixtures for tests and the demo
(`eval.fixtures`)."""

# Each rank scores 1/world of the documents (eval.sharded); the planner prices evaluation by this
# (recipes.planning.eval_cost). Here, not in eval.in_loop: the planner answers without importing torch.
SPLITS_REQUESTS_OVER_RANKS = True

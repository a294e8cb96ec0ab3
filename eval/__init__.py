"""MMLU and GSM8K through lm-eval: lm-eval's own tasks on the offline layouts that `data_prep.benchmark_files.layouts`
reads (`eval.harness`, with lm-eval's HF model as `eval.timed_lm` runs it), the standalone runner
(`python -m eval.run`), the in-loop hook (`eval.in_loop`), and generated fixtures for tests and the demo
(`eval.fixtures`)."""

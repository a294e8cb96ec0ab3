"""MMLU and GSM8K through lm-eval: offline layouts (`eval.data`), lm-eval's own tasks on them
(`eval.harness`), the standalone runner (`python -m eval.run`), the in-loop hook (`eval.in_loop`), and
generated fixtures for tests and the demo (`eval.fixtures`)."""

"""Benchmark evaluation (MMLU and GSM8K through lm-eval, standalone and in the training loop).

Not built yet: the training loop reports validation loss only. Tracked as the benchmarks issue.
"""

"""Summarise a finished run: losses, throughput, memory, a sample from the exported model, and where things are.

python -m recipes.summarize outputs/demo/run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from recipes.metrics import read_metrics

SAMPLE_PROMPT = "def "


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    run = args.output_dir
    records = read_metrics(run / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if not train:
        parser.error(f"{run / 'metrics.jsonl'} has no training records: did the run start?")
    summary = json.loads((run / "run_summary.json").read_text()) if (run / "run_summary.json").exists() else {}

    print(f"\nrun: {run}")
    print(f"  steps: {train[-1]['step']}  ({summary.get('stop_reason', 'unknown stop reason')})")
    print(f"  train loss: {train[0]['loss']:.3f} at step {train[0]['step']} -> {train[-1]['loss']:.3f}")
    if evals:
        trail = " -> ".join(f"{r['eval_loss']:.3f} (step {r['step']})" for r in evals)
        print(f"  eval loss: {trail}")
    tokens_per_s = sorted(r["tokens_per_s"] for r in train)
    print(f"  throughput: median {tokens_per_s[len(tokens_per_s) // 2]:.0f} tokens/s over all ranks")
    if "peak_host_memory_gb_per_rank" in summary:
        peaks = ", ".join(f"rank {i}: {gb:.2f} GB" for i, gb in enumerate(summary["peak_host_memory_gb_per_rank"]))
        print(f"  peak host memory: {peaks}")
    if "wall_seconds" in summary:
        print(f"  wall time of the launch: {summary['wall_seconds']:.0f} s")

    final = run / "final"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    prompt = tokenizer(SAMPLE_PROMPT, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
    sample = tokenizer.decode(output[0], skip_special_tokens=True)
    print("  greedy sample from final/:")
    print("    " + sample.replace("\n", "\n    "))
    print(f"\n  model (HF safetensors + tokenizer): {final}")
    print(f"  metrics: {run / 'metrics.jsonl'}  (TensorBoard: tensorboard --logdir {run / 'tensorboard'})")
    print(f"  loss plot: {run / 'loss.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Summarise a finished run: losses, throughput, memory, a sample from the exported model, and where things are.

python -m recipes.summarize outputs/demo/run
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from recipes.telemetry.metrics import read_metrics, run_report

SAMPLE_PROMPT = "def "


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    run = args.output_dir
    if not read_metrics(run / "metrics.jsonl"):
        parser.error(f"{run / 'metrics.jsonl'} has no records: did the run start?")
    print()
    print(run_report(run))

    final = run / "final"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    prompt = tokenizer(SAMPLE_PROMPT, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
    sample = tokenizer.decode(output[0], skip_special_tokens=True)
    print("greedy sample from final/:")
    print("    " + sample.replace("\n", "\n    "))
    print(f"\nmodel (HF safetensors + tokenizer): {final}")
    print(f"metrics: {run / 'metrics.jsonl'}  (TensorBoard: tensorboard --logdir {run / 'tensorboard'})")
    print(f"loss plot: {run / 'loss.png'}   report: {run / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

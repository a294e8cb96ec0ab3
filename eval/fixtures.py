"""Small MMLU- and GSM8K-shaped data sets written here, in both layouts each, for tests and the demo.

    python -m eval.fixtures --output outputs/demo/eval_data

The questions are generated (arithmetic and Python facts), so nothing is downloaded and nothing is copied
from the real benchmarks; they exercise the same prompts, extraction and metrics.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
from pathlib import Path

SUBJECTS = ("elementary_mathematics", "high_school_computer_science")


def _arithmetic(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    answer = a + b
    wrong = rng.sample([answer + d for d in (-3, -2, -1, 1, 2, 3, 10)], 3)
    choices = [str(answer), *map(str, wrong)]
    rng.shuffle(choices)
    return f"What is {a} + {b}?", choices, choices.index(str(answer))


def _python_fact(rng: random.Random) -> tuple[str, list[str], int]:
    items = rng.randint(1, 6)
    literal = "[" + ", ".join(str(rng.randint(0, 9)) for _ in range(items)) + "]"
    choices = [str(items), str(items + 1), str(max(items - 1, 0) if items > 1 else items + 2), str(items * 2 + 1)]
    correct = choices[0]
    rng.shuffle(choices)
    return f"In Python, what does len({literal}) return?", choices, choices.index(correct)


def mmlu_rows(subject: str, count: int, seed: int) -> list[tuple[str, list[str], int]]:
    rng = random.Random(f"{subject}-{seed}")
    make = _arithmetic if subject == "elementary_mathematics" else _python_fact
    return [make(rng) for _ in range(count)]


def gsm8k_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(f"gsm8k-{seed}")
    names, things = ("Ana", "Ben", "Chen", "Dina", "Emeka"), ("apples", "pencils", "stickers", "marbles")
    rows = []
    for _ in range(count):
        name, thing = rng.choice(names), rng.choice(things)
        have, buy, give = rng.randint(3, 30), rng.randint(2, 20), rng.randint(1, 3)
        total = have + buy - give
        question = f"{name} has {have} {thing}, buys {buy} more and gives away {give}. How many {thing} are left?"
        answer = (
            f"After buying, {name} has {have} + {buy} = <<{have}+{buy}={have + buy}>>{have + buy} {thing}.\n"
            f"After giving some away, {have + buy} - {give} = <<{have + buy}-{give}={total}>>{total} are left.\n"
            f"#### {total}"
        )
        rows.append({"question": question, "answer": answer})
    return rows


def write(output: str | Path, test_per_subject: int = 8, gsm8k_test: int = 8) -> dict[str, Path]:
    """Both layouts of both benchmarks under `output`; returns the four directories."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(output)
    dirs = {
        "mmlu_csv": root / "mmlu_release",
        "mmlu_parquet": root / "mmlu_hub",
        "gsm8k_jsonl": root / "gsm8k_release",
        "gsm8k_parquet": root / "gsm8k_hub",
    }
    for subject in SUBJECTS:
        for split, count, seed in (("test", test_per_subject, 0), ("dev", 5, 1)):
            rows = mmlu_rows(subject, count, seed)
            path = dirs["mmlu_csv"] / split / f"{subject}_{split}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", newline="", encoding="utf-8") as handle:
                writer = csv.writer(handle)
                for question, choices, answer in rows:
                    writer.writerow([question, *choices, "ABCD"[answer]])
            table = pa.table(
                {
                    "question": [q for q, _, _ in rows],
                    "subject": [subject] * len(rows),
                    "choices": [c for _, c, _ in rows],
                    "answer": [a for _, _, a in rows],
                }
            )
            (dirs["mmlu_parquet"] / subject).mkdir(parents=True, exist_ok=True)
            pq.write_table(table, dirs["mmlu_parquet"] / subject / f"{split}-00000-of-00001.parquet")
    for split, count, seed in (("test", gsm8k_test, 0), ("train", 10, 1)):
        rows = gsm8k_rows(count, seed)
        dirs["gsm8k_jsonl"].mkdir(parents=True, exist_ok=True)
        (dirs["gsm8k_jsonl"] / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (dirs["gsm8k_parquet"] / "main").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), dirs["gsm8k_parquet"] / "main" / f"{split}-00000-of-00001.parquet")
    return dirs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    for name, path in write(args.output).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()

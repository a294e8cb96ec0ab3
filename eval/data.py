"""Local copies of MMLU and GSM8K, in the layouts people actually have on an offline cluster.

MMLU
  release layout (the original tarball):  DIR/test/<subject>_test.csv, DIR/dev/<subject>_dev.csv
                                          no header; columns question, A, B, C, D, answer letter
  hub snapshot of cais/mmlu:              DIR/<subject>/test-*.parquet, DIR/<subject>/dev-*.parquet
                                          columns question, subject, choices (4 strings), answer (0-3)
GSM8K
  release layout (openai/grade-school-math): DIR/test.jsonl, DIR/train.jsonl with question and answer,
                                             the answer ending in "#### N"
  hub snapshot of openai/gsm8k:              DIR/main/test-*.parquet, DIR/main/train-*.parquet

Both layouts load into the hub datasets' schema, which is what lm-eval's own `mmlu_*` and `gsm8k` task
configs read; `check_*` validates a directory before any training starts, naming what was expected.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

MMLU_COLUMNS = ("question", "subject", "choices", "answer")
LETTERS = "ABCD"


class BenchmarkDataError(ValueError):
    """A benchmark data directory is missing or malformed; the message names what was expected."""


def mmlu_layout(directory: str | Path) -> tuple[str, list[str]]:
    """('csv' | 'parquet', subjects found) for an MMLU directory; raises naming the expected layouts."""
    root = Path(directory)
    if not root.is_dir():
        raise BenchmarkDataError(f"mmlu_dir {root} does not exist or is not a directory")
    csv_subjects = sorted(p.name[: -len("_test.csv")] for p in (root / "test").glob("*_test.csv"))
    if csv_subjects:
        return "csv", csv_subjects
    parquet_subjects = sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("test-*.parquet")))
    if parquet_subjects:
        return "parquet", parquet_subjects
    raise BenchmarkDataError(
        f"mmlu_dir {root} holds no MMLU data: expected the release layout (test/<subject>_test.csv and "
        "dev/<subject>_dev.csv) or a cais/mmlu snapshot (<subject>/test-*.parquet and <subject>/dev-*.parquet)"
    )


def _mmlu_csv_split(path: Path, subject: str) -> list[dict]:
    if not path.is_file():
        raise BenchmarkDataError(f"MMLU {subject}: {path} is missing (the release layout has test/ and dev/ csv files)")
    rows = []
    with open(path, newline="", encoding="utf-8") as handle:
        for line, fields in enumerate(csv.reader(handle), start=1):
            if len(fields) != 6 or fields[5].strip() not in LETTERS:
                raise BenchmarkDataError(
                    f"{path}:{line}: expected 6 columns (question, A, B, C, D, answer letter A-D), got {fields[:6]}"
                )
            rows.append(
                {
                    "question": fields[0],
                    "subject": subject,
                    "choices": fields[1:5],
                    "answer": LETTERS.index(fields[5].strip()),
                }
            )
    if not rows:
        raise BenchmarkDataError(f"{path} is empty")
    return rows


def _parquet_split(files: list[Path], columns: tuple[str, ...], what: str) -> list[dict]:
    import pyarrow.parquet as pq

    if not files:
        raise BenchmarkDataError(f"{what}: no parquet file found")
    rows = []
    for path in files:
        table = pq.read_table(path)
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise BenchmarkDataError(f"{path}: columns {missing} missing (has {table.column_names})")
        rows.extend(table.select(list(columns)).to_pylist())
    return rows


def load_mmlu_subject(directory: str | Path, subject: str, **_) -> dict[str, list[dict]]:
    """{'test': [...], 'dev': [...]} in cais/mmlu's schema."""
    root = Path(directory)
    layout, _ = mmlu_layout(root)
    if layout == "csv":
        return {split: _mmlu_csv_split(root / split / f"{subject}_{split}.csv", subject) for split in ("test", "dev")}
    return {
        split: _parquet_split(
            sorted((root / subject).glob(f"{split}-*.parquet")), MMLU_COLUMNS, f"MMLU {subject} {split}"
        )
        for split in ("test", "dev")
    }


def gsm8k_layout(directory: str | Path) -> str:
    root = Path(directory)
    if not root.is_dir():
        raise BenchmarkDataError(f"gsm8k_dir {root} does not exist or is not a directory")
    if (root / "test.jsonl").is_file():
        return "jsonl"
    if any((root / "main").glob("test-*.parquet")):
        return "parquet"
    raise BenchmarkDataError(
        f"gsm8k_dir {root} holds no GSM8K data: expected OpenAI's release (test.jsonl and train.jsonl) or an "
        "openai/gsm8k snapshot (main/test-*.parquet and main/train-*.parquet)"
    )


def _gsm8k_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise BenchmarkDataError(f"GSM8K: {path} is missing (the release layout has test.jsonl and train.jsonl)")
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                raise BenchmarkDataError(f"{path}:{line}: not valid JSON") from None
            if not isinstance(record.get("question"), str) or "####" not in str(record.get("answer", "")):
                raise BenchmarkDataError(f"{path}:{line}: expected 'question' and an 'answer' ending in '#### N'")
            rows.append({"question": record["question"], "answer": record["answer"]})
    return rows


def load_gsm8k(directory: str | Path, **_) -> dict[str, list[dict]]:
    """{'test': [...], 'train': [...]} in openai/gsm8k's schema."""
    root = Path(directory)
    if gsm8k_layout(root) == "jsonl":
        return {split: _gsm8k_jsonl(root / f"{split}.jsonl") for split in ("test", "train")}
    return {
        split: _parquet_split(
            sorted((root / "main").glob(f"{split}-*.parquet")), ("question", "answer"), f"GSM8K {split}"
        )
        for split in ("test", "train")
    }


def check_mmlu(directory: str | Path) -> list[str]:
    """Every subject loads; returns the subjects. Raises BenchmarkDataError naming the problem."""
    _, subjects = mmlu_layout(directory)
    for subject in subjects:
        load_mmlu_subject(directory, subject)
    return subjects


def check_gsm8k(directory: str | Path) -> int:
    """The directory loads; returns the number of test problems."""
    return len(load_gsm8k(directory)["test"])

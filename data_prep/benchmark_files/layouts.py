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
import re
from pathlib import Path

MMLU_COLUMNS = ("question", "subject", "choices", "answer")
LETTERS = ("A", "B", "C", "D")
GSM8K_ANSWER = re.compile(r"####\s*-?[\d,]*\.?\d+\s*$")


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
    """Rows of one release csv. Errors name file:line and what was wrong, never the row itself: benchmark questions
    do not belong in logs."""
    if not path.is_file():
        raise BenchmarkDataError(f"MMLU {subject}: {path} is missing (the release layout has test/ and dev/ csv files)")
    rows = []
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            for line, fields in enumerate(csv.reader(handle), start=1):
                if len(fields) != 6:
                    raise BenchmarkDataError(
                        f"{path}:{line}: {len(fields)} columns; expected 6 (question, A, B, C, D, answer letter)"
                    )
                answer = fields[5].strip()
                if len(answer) != 1 or answer not in LETTERS:
                    shown = "blank" if not answer else f"{len(answer)} characters" if len(answer) > 1 else "not A-D"
                    raise BenchmarkDataError(f"{path}:{line}: the answer must be one letter A, B, C or D ({shown})")
                row = {"question": fields[0], "subject": subject, "choices": fields[1:5],
                       "answer": LETTERS.index(answer)}  # fmt: skip
                problem = _mmlu_row_problem(row)
                if problem:
                    raise BenchmarkDataError(f"{path}:{line}: {problem}")
                rows.append(row)
    except UnicodeDecodeError as error:
        raise BenchmarkDataError(f"{path}: not UTF-8 (byte {error.start})") from None
    except csv.Error as error:
        raise BenchmarkDataError(f"{path}: not a valid csv file ({error})") from None
    if not rows:
        raise BenchmarkDataError(f"{path} is empty: every subject needs test questions and few-shot (dev) examples")
    return rows


HUB_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.parquet$")


def split_files(folder: Path, split: str) -> list[Path]:
    """A split's parquet files in a hub snapshot's folder, checked as one set: the hub names them
    `<split>-00000-of-00002.parquet`, ...; a set with a shard missing, two sets (an older revision's beside a newer),
    or a stray copy beside a set (`... (1).parquet`) would load part of the split, or some of it twice."""
    files = sorted(folder.glob(f"{split}-*.parquet"))
    numbered = {path: HUB_SHARD.search(path.name) for path in files}
    if not any(numbered.values()):
        return files  # named otherwise (one file, as some copies have): read as they are
    strays = [path.name for path, match in numbered.items() if not match]
    totals = {int(match.group(2)) for match in numbered.values() if match}
    indices = sorted(int(match.group(1)) for match in numbered.values() if match)
    if strays or len(totals) != 1 or indices != list(range(next(iter(totals)))):
        raise BenchmarkDataError(
            f"{folder}: the {split} split's parquet files are not one complete set "
            f"({', '.join(path.name for path in files)}): expected {split}-00000-of-0000N.parquet up to N-1, each "
            "once, and nothing else; copy the snapshot again"
        )
    return files


def _parquet_split(files: list[Path], columns: tuple[str, ...], what: str, check=None) -> list[dict]:
    """Rows of a hub snapshot's parquet files; `check(row)` returns what is wrong with a row, if anything."""
    import pyarrow.parquet as pq

    if not files:
        raise BenchmarkDataError(f"{what}: no parquet file found")
    rows = []
    for path in files:
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as error:
            raise BenchmarkDataError(f"{path}: not a readable parquet file ({type(error).__name__})") from None
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise BenchmarkDataError(f"{path}: columns {missing} missing (has {table.column_names})")
        for index, row in enumerate(table.select(list(columns)).to_pylist()):
            problem = check(row) if check else None
            if problem:
                raise BenchmarkDataError(f"{path}: row {index}: {problem}")
            rows.append(row)
    if not rows:
        raise BenchmarkDataError(f"{what}: the parquet files hold no rows")
    return rows


def _mmlu_row_problem(row: dict) -> str | None:
    """What is wrong with one MMLU row in cais/mmlu's schema, the same rules for both layouts. An empty question is
    legal: MMLU has such a row (in sociology's test split), kept by every copy, whose choices carry the question."""
    answer, choices = row["answer"], row["choices"]
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer <= 3:
        return "answer must be an integer 0-3 (the index of the right choice)"
    if not isinstance(choices, list) or len(choices) != 4 or not all(isinstance(c, str) for c in choices):
        return "choices must be a list of 4 strings"
    empty = [LETTERS[i] for i, choice in enumerate(choices) if not choice.strip()]
    if empty:
        return f"choice {', '.join(empty)} is empty"
    if not isinstance(row["question"], str):
        return "question must be a string (it may be empty)"
    return None


def _gsm8k_problem(record) -> str | None:
    """What is wrong with one GSM8K record (a JSON object with a question and an answer ending in `#### N`)."""
    if not isinstance(record, dict):
        return f"expected a JSON object, found a JSON {type(record).__name__}"
    if not isinstance(record.get("question"), str) or not record["question"].strip():
        return "expected a non-empty 'question' string"
    answer = record.get("answer")
    if not isinstance(answer, str) or not GSM8K_ANSWER.search(answer):
        return "expected an 'answer' string ending in '#### N' (N a number)"
    return None


def load_mmlu_subject(directory: str | Path, subject: str, **_) -> dict[str, list[dict]]:
    """{'test': [...], 'dev': [...]} in cais/mmlu's schema."""
    root = Path(directory)
    layout, _ = mmlu_layout(root)
    if layout == "csv":
        return {split: _mmlu_csv_split(root / split / f"{subject}_{split}.csv", subject) for split in ("test", "dev")}
    return {
        split: _parquet_split(
            split_files(root / subject, split),
            MMLU_COLUMNS,
            f"MMLU {subject} {split}",
            _mmlu_row_problem,
        )  # fmt: skip
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
    try:
        with open(path, encoding="utf-8-sig", errors="strict") as handle:
            for line, text in enumerate(handle, start=1):
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError:
                    raise BenchmarkDataError(f"{path}:{line}: not valid JSON") from None
                problem = _gsm8k_problem(record)
                if problem:
                    raise BenchmarkDataError(f"{path}:{line}: {problem}")
                rows.append({"question": record["question"], "answer": record["answer"]})
    except UnicodeDecodeError:
        line, byte = _first_undecodable_line(path)
        raise BenchmarkDataError(f"{path}:{line}: not UTF-8 (byte {byte} of the line); save it as UTF-8") from None
    if not rows:
        raise BenchmarkDataError(f"{path} holds no problems: GSM8K needs test problems and few-shot (train) examples")
    return rows


def _first_undecodable_line(path: Path) -> tuple[int, int]:
    """The line (from 1) and byte in it (from 0) where `path` stops being UTF-8: text-mode reading decodes in
    blocks, so its error says neither. A newline byte never occurs inside a UTF-8 character, so lines decode alone."""
    with open(path, "rb") as handle:
        for line, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as error:
                return line, error.start
    return 0, 0  # not reached: the text-mode read failed on one of these lines


def load_gsm8k(directory: str | Path, **_) -> dict[str, list[dict]]:
    """{'test': [...], 'train': [...]} in openai/gsm8k's schema."""
    root = Path(directory)
    if gsm8k_layout(root) == "jsonl":
        return {split: _gsm8k_jsonl(root / f"{split}.jsonl") for split in ("test", "train")}
    return {
        split: _parquet_split(
            split_files(root / "main", split),
            ("question", "answer"),
            f"GSM8K {split}",
            _gsm8k_problem,
        )  # fmt: skip
        for split in ("test", "train")
    }


# The few-shot pools of the hub copies, for a check without local data: cais/mmlu's dev split holds exactly 5 rows
# per subject; openai/gsm8k's train split (lm-eval's few-shot split for GSM8K) 7,473.
HUB_MMLU_DEV_ROWS = 5
HUB_GSM8K_TRAIN_ROWS = 7473


def mmlu_split_rows(directory: str | Path) -> dict[str, dict[str, int]]:
    """Every subject loads (BenchmarkDataError names the problem); each subject's rows per split (test: scored, dev:
    the few-shot examples)."""
    _, subjects = mmlu_layout(directory)
    return {subject: {split: len(rows) for split, rows in load_mmlu_subject(directory, subject).items()}
            for subject in subjects}  # fmt: skip


def mmlu_dev_rows(directory: str | Path) -> dict[str, int]:
    """The rows of each subject's few-shot split (every subject loads)."""
    return {subject: rows["dev"] for subject, rows in mmlu_split_rows(directory).items()}


def check_mmlu(directory: str | Path) -> list[str]:
    """Every subject loads; returns the subjects. Raises BenchmarkDataError naming the problem."""
    return list(mmlu_split_rows(directory))


def gsm8k_split_rows(directory: str | Path) -> dict[str, int]:
    """The directory loads; the problems of each split (test: scored, train: lm-eval's few-shot split)."""
    return {split: len(rows) for split, rows in load_gsm8k(directory).items()}


def check_gsm8k(directory: str | Path) -> int:
    """The directory loads; returns the number of test problems."""
    return gsm8k_split_rows(directory)["test"]

"""Build a small corpus of real text that every Python installation has: its standard library.

    python -m data_prep.demo_corpus --output data/demo --train-mb 6 --validation-mb 0.5

Each .py file becomes one jsonl document. Files are taken in a fixed shuffled order, and every 20th goes
to validation, so the split is the same on every machine with the same Python version and
no validation document is in training.
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

VALIDATION_EVERY = 20
SHUFFLE_SEED = 0
SKIP_PARTS = {"site-packages", "encodings", "test", "tests", "idlelib"}
MAX_FILE_BYTES = 200_000


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """Standard-library modules (or those under `root`) in a fixed shuffled order, so that any prefix of
    the corpus is a sample of the whole library rather than a run of one package (the codec tables of
    `encodings/` alone would otherwise fill a demo's first minutes)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in root.rglob("*.py") if not SKIP_PARTS.intersection(p.relative_to(root).parts) and p.is_file()
    )
    random.Random(SHUFFLE_SEED).shuffle(paths)
    return paths


def build(output: Path, train_bytes: int, validation_bytes: int, roots: list[Path] | None = None) -> dict[str, int]:
    output.mkdir(parents=True, exist_ok=True)
    budgets = {"train": train_bytes, "validation": validation_bytes}
    written = {"train": 0, "validation": 0}
    with (
        open(output / "train.jsonl", "w", encoding="utf-8") as train,
        open(output / "validation.jsonl", "w", encoding="utf-8") as validation,
    ):
        handles = {"train": train, "validation": validation}
        paths = [path for root in roots or [None] for path in stdlib_sources(root)]
        for index, path in enumerate(paths):
            split = "validation" if index % VALIDATION_EVERY == 0 else "train"
            if written[split] >= budgets[split]:
                if all(written[s] >= budgets[s] for s in budgets):
                    break
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip() or len(text) > MAX_FILE_BYTES:
                continue
            handles[split].write(json.dumps({"text": text}) + "\n")
            written[split] += len(text.encode("utf-8"))
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--train-mb", type=float, default=6.0)
    parser.add_argument("--validation-mb", type=float, default=0.5)
    parser.add_argument(
        "--root", nargs="*", type=Path, help="directories of .py files instead of the standard library (in order)"
    )
    args = parser.parse_args(argv)
    written = build(Path(args.output), int(args.train_mb * 1e6), int(args.validation_mb * 1e6), args.root)
    print(
        f"wrote {written['train'] / 1e6:.1f} MB train, {written['validation'] / 1e6:.1f} MB validation "
        f"of Python source to {args.output}"
    )


if __name__ == "__main__":  # the same command by its module path
    main()

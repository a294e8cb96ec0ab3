"""The exit code a run's error stands for (the table in docs/run-safety.md), and the line that says it."""

from __future__ import annotations

from common.exit_codes import DISK_FULL, disk_full, disk_full_line
from recipes.config import ConfigError
from recipes.training.checkpointing import CheckpointSaveError
from recipes.training.run_state import TrainingFault
from recipes.training.train_data import DataStallError

CODES = {ConfigError: 2, TrainingFault: 3, CheckpointSaveError: 4, DataStallError: 5}


def run_exit(error: BaseException, output_dir: str) -> tuple[int, str] | None:
    """(exit code, the line to log) for an error the run names, None for one it does not (a bug: a traceback and
    1). A full disk is a failed save (4) wherever it struck: final/'s export said it as bad input (2), and a write of
    metrics.jsonl or the report ended in a traceback (1)."""
    full = disk_full(error)
    if full is not None:
        said = str(error) if isinstance(error, tuple(CODES)) else disk_full_line(output_dir, full, "the run resumes",
                                                                                 "output_dir")  # fmt: skip
        return DISK_FULL, said
    code = next((code for kind, code in CODES.items() if isinstance(error, kind)), None)
    return None if code is None else (code, str(error))

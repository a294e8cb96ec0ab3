"""Documents of the local MMLU and GSM8K layouts for the task YAMLs beside this file. lm-eval calls these with the
task's `dataset_kwargs` and the `--metadata` of its command line (or the TaskManager's metadata).

Under the `lm_eval` command line a missing or malformed directory ends the command with one line naming the directory
(or file and line) instead of a traceback from inside lm-eval; this package's own callers pass `raise_errors` in the
metadata and get the exception.
"""

from __future__ import annotations


def _as_dataset_dict(splits: dict[str, list[dict]]):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def _directory(metadata_key: str, value: str | None) -> str:
    if not value:
        raise SystemExit(
            f'error: the local task needs its data directory: pass --metadata \'{{"{metadata_key}": "/path/to/data"}}\''
        )
    return value


def _load(load, directory: str, raise_errors, *args):
    from data_prep.benchmark_files.layouts import BenchmarkDataError

    try:
        return _as_dataset_dict(load(directory, *args))
    except BenchmarkDataError as error:
        if raise_errors:
            raise
        raise SystemExit(f"error: {error}") from None


def mmlu_subject(subject: str, mmlu_dir: str | None = None, raise_errors=False, **_):
    from data_prep.benchmark_files.layouts import load_mmlu_subject

    return _load(lambda d, s: load_mmlu_subject(d, s), _directory("mmlu_dir", mmlu_dir), raise_errors, subject)


def gsm8k(gsm8k_dir: str | None = None, raise_errors=False, **_):
    from data_prep.benchmark_files.layouts import load_gsm8k

    return _load(load_gsm8k, _directory("gsm8k_dir", gsm8k_dir), raise_errors)

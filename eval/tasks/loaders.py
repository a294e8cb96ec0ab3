"""Documents of the local MMLU and GSM8K layouts for the task YAMLs beside this file. lm-eval calls these with the
task's `dataset_kwargs` and the `--metadata` of its command line (or the TaskManager's metadata)."""

from __future__ import annotations


def _as_dataset_dict(splits: dict[str, list[dict]]):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def _directory(metadata_key: str, value: str | None) -> str:
    if not value:
        raise ValueError(
            f'the local task needs its data directory: pass --metadata \'{{"{metadata_key}": "/path/to/data"}}\''
        )
    return value


def mmlu_subject(subject: str, mmlu_dir: str | None = None, **_):
    from data_prep.benchmark_files import load_mmlu_subject

    return _as_dataset_dict(load_mmlu_subject(_directory("mmlu_dir", mmlu_dir), subject))


def gsm8k(gsm8k_dir: str | None = None, **_):
    from data_prep.benchmark_files import load_gsm8k

    return _as_dataset_dict(load_gsm8k(_directory("gsm8k_dir", gsm8k_dir)))

"""MMLU and GSM8K through lm-eval, on local data or the hub, for a plain model or a live ZeRO-3 one.

The tasks are lm-eval's own: each `mmlu_<subject>` and `gsm8k` config is read from lm-eval's task
directory (prompt template, few-shot split and sampler, target, filters, metrics), and only where the
documents come from is replaced, by a loader for the local layouts of `eval.data`. The subjects are grouped
like lm-eval's `mmlu` group (accuracy averaged weighted by subject size). With no local directory, the stock
hub tasks are used, which needs the network.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.data import load_gsm8k, load_mmlu_subject, mmlu_layout

logger = logging.getLogger("eval")
SUPPORTED_TASKS = ("mmlu", "gsm8k")


@dataclass
class BenchmarkSettings:
    tasks: list[str]
    mmlu_dir: str | None = None
    gsm8k_dir: str | None = None
    limit: int | None = None  # documents per task (per MMLU subject)
    num_fewshot: int = 5
    batch_size: int = 8
    max_gen_toks: int | None = None  # GSM8K answer budget; None keeps lm-eval's (256)

    def check(self) -> None:
        """Before any expensive work: known task names, and local data that loads."""
        from eval.data import check_gsm8k, check_mmlu

        unknown = [task for task in self.tasks if task not in SUPPORTED_TASKS]
        if unknown:
            raise ValueError(f"eval_tasks: {unknown} unknown; supported: {list(SUPPORTED_TASKS)} (or [] for none)")
        if "mmlu" in self.tasks and self.mmlu_dir:
            check_mmlu(self.mmlu_dir)
        if "gsm8k" in self.tasks and self.gsm8k_dir:
            check_gsm8k(self.gsm8k_dir)


def _as_dataset_dict(splits: dict[str, list[dict]]):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def _local_mmlu_subject(directory: str, subject: str, **_):
    return _as_dataset_dict(load_mmlu_subject(directory, subject))


def _local_gsm8k(directory: str, **_):
    return _as_dataset_dict(load_gsm8k(directory))


@functools.lru_cache(maxsize=1)
def task_manager():
    """lm-eval's task index over its mmlu and gsm8k directories only: indexing all of lm-eval's tasks reads
    ~27k YAML files (~8 s on our CPU), at every evaluation."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    tasks_root = Path(lm_eval.tasks.__file__).parent
    return TaskManager(include_path=[tasks_root / "mmlu" / "default", tasks_root / "gsm8k"], include_defaults=False)


def _lm_eval_config(task_manager, name: str) -> dict[str, Any]:
    """lm-eval's own config of a task or group, includes resolved."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = task_manager.task_index.get(name)
    if entry is None or entry.yaml_path is None:
        raise ValueError(f"this lm-eval has no task or group {name!r}")
    return dict(load_yaml(entry.yaml_path, resolve_func=True))


def _local_task(task_manager, name: str, loader):
    """lm-eval's own task `name` (prompt, few-shot split and sampler, filters, metrics), reading its
    documents from `loader` instead of the hub."""
    from lm_eval.api.task import ConfigurableTask

    config = _lm_eval_config(task_manager, name)
    for structural in ("tag", "group", "task_list"):
        config.pop(structural, None)
    config["custom_dataset"] = loader
    return ConfigurableTask(config=config)


def task_specs(settings: BenchmarkSettings) -> list:
    """What to hand to `lm_eval.simple_evaluate(tasks=...)`: hub task names, or lm-eval's tasks on local data."""
    from lm_eval.api.group import Group
    from lm_eval.config.group import GroupConfig

    manager = task_manager()
    specs: list = []
    if "mmlu" in settings.tasks and settings.mmlu_dir:
        _, subjects = mmlu_layout(settings.mmlu_dir)
        # lm-eval's `mmlu` group with its own aggregation (accuracy weighted by subject size) over the
        # subjects present locally.
        group_config = _lm_eval_config(manager, "mmlu")
        group_config["task"] = [f"mmlu_{subject}" for subject in subjects]
        group = Group.from_config(GroupConfig(**group_config))
        for subject in subjects:
            loader = functools.partial(_local_mmlu_subject, settings.mmlu_dir, subject)
            group.add(_local_task(manager, f"mmlu_{subject}", loader))
        specs.append(group)
    elif "mmlu" in settings.tasks:
        specs.append("mmlu")
    if "gsm8k" in settings.tasks and settings.gsm8k_dir:
        specs.append(_local_task(manager, "gsm8k", functools.partial(_local_gsm8k, settings.gsm8k_dir)))
    elif "gsm8k" in settings.tasks:
        specs.append("gsm8k")
    return specs


def evaluate(model, tokenizer, settings: BenchmarkSettings, synced_generation: bool = False) -> dict:
    """lm-eval's results dict (`results`, `n-samples`, `configs`, ...) for `model`, a transformers causal LM.

    Under ZeRO-3 every rank must call this with the same settings: every rank then runs the same requests in
    the same order with the same batch size, so every forward pass is matched on every rank, and generation
    is synchronised (`synced_gpus`) so that no rank leaves the loop while another still needs its shards.
    """
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size)
    gen_kwargs: dict[str, Any] = {}
    if synced_generation:
        gen_kwargs["synced_gpus"] = True
    if settings.max_gen_toks is not None:
        gen_kwargs["max_gen_toks"] = settings.max_gen_toks
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=task_specs(settings),
        num_fewshot=settings.num_fewshot,
        limit=settings.limit,
        gen_kwargs=gen_kwargs or None,
        log_samples=False,
        task_manager=task_manager(),
        bootstrap_iters=1000,
        verbosity="ERROR",
    )
    return jsonable(results)


def jsonable(value):
    """lm-eval's results hold callables and other objects in `configs`; keep what JSON can say."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def headline_scores(results: dict) -> dict[str, float]:
    """Flat metrics for logging: `mmlu/acc`, `mmlu/<subject>/acc`, `gsm8k/exact_match_strict`, `..._flexible`."""
    scores: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or "stderr" in key or "," not in key:
                continue
            metric, filter_name = key.split(",", 1)
            if task == "mmlu" and metric == "acc":
                scores["mmlu/acc"] = float(value)
            elif task.startswith("mmlu_") and metric == "acc":
                scores[f"mmlu/{task[len('mmlu_') :]}/acc"] = float(value)
            elif task == "gsm8k" and metric == "exact_match":
                scores[f"gsm8k/exact_match_{filter_name.split('-')[0]}"] = float(value)
    return scores


def format_table(results: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(results)


def write_results(results: dict, path: str | Path) -> None:
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str))

"""MMLU and GSM8K through lm-eval's public API, on local data or the hub, for a model directory or a live model.

The local tasks are YAML files in `eval/tasks/` (`mmlu_local` and its 57 `mmlu_local_<subject>` tasks, and
`gsm8k_local`) that carry lm-eval's own MMLU and GSM8K prompts, few-shot splits and samplers, filters and metrics,
and read their documents from a local directory through `eval/tasks/loaders.py`. The standard CLI runs them too:

    lm_eval --model hf --model_args pretrained=DIR,add_bos_token=False --include_path eval/tasks \
        --tasks mmlu_local,gsm8k_local --metadata '{"mmlu_dir": "/data/eval/mmlu", "gsm8k_dir": "/data/eval/gsm8k"}'

(`add_bos_token=False`: training never puts a BOS token before a document, see `eval.timed_lm.ADD_BOS_TOKEN`.)
With no local directory, lm-eval's stock hub tasks (`mmlu`, `gsm8k`) are used, which needs the network.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.files import atomic_write_text
from data_prep.benchmark_files.layouts import mmlu_layout
from eval.agreement import EvaluationStopped, FailedOnAnotherRank
from eval.timed_lm import ADD_BOS_TOKEN, PromptLengths, timed_lm_class

logger = logging.getLogger("eval")
SUPPORTED_TASKS = ("mmlu", "gsm8k")
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
MMLU_SUBJECTS = tuple(sorted(p.stem[len("mmlu_local_") :] for p in TASKS_DIR.glob("mmlu_local_*.yaml")))


# What the user calls each BenchmarkSettings field: eval.run's flags; the training recipe passes its keys.
HFLM_MAX_GEN_TOKS = 256  # lm-eval's HF model's answer budget when none is given
FLAG_NAMES = {"tasks": "--tasks", "limit": "--limit", "num_fewshot": "--num-fewshot", "batch_size": "--batch-size",
              "max_gen_toks": "--max-gen-toks", "mmlu_dir": "--mmlu-dir", "gsm8k_dir": "--gsm8k-dir"}  # fmt: skip
# The variables that keep huggingface_hub and datasets off the network, and the values they read as set
OFFLINE_VARIABLES, OFFLINE_VALUES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"), {"1", "ON", "YES", "TRUE"}
HUB_DATASETS = {"mmlu": "cais/mmlu", "gsm8k": "openai/gsm8k"}  # lm-eval's stock tasks' dataset_path


def hub_copy_cached(task: str) -> bool:
    """Whether the hub dataset of `task` is in this machine's Hugging Face cache (hub snapshots, or `datasets`'
    prepared copies), which offline mode reads: a cluster that cached it on a login node may set HF_HUB_OFFLINE."""
    import datasets.config
    import huggingface_hub.constants

    owner, name = HUB_DATASETS[task].split("/")
    return (Path(huggingface_hub.constants.HF_HUB_CACHE) / f"datasets--{owner}--{name}").is_dir() or (
        Path(datasets.config.HF_DATASETS_CACHE) / f"{owner}___{name}").is_dir()  # fmt: skip


@dataclass
class BenchmarkSettings:
    tasks: list[str]
    mmlu_dir: str | None = None
    gsm8k_dir: str | None = None
    limit: int | None = None  # documents per task (per MMLU subject)
    num_fewshot: int = 5
    batch_size: int = 8
    max_gen_toks: int | None = None  # GSM8K answer budget; None keeps lm-eval's (256)
    log_samples: bool = False  # every document's prompt, answers and scores in the results (`samples`)

    def check(self, names: dict[str, str] | None = None, positions: int | None = None) -> list[str]:
        """Before any expensive work: known task names, numbers that can work, and local data that loads with a
        few-shot split large enough. `names` maps the fields to what the user set (eval.run's flags by default).
        Any number of test documents works on any number of ranks (`eval.sharded`). With the model's `positions`
        (max_position_embeddings), a GSM8K answer budget that leaves no room for a prompt is refused: lm-eval fails
        on it only at the first generation, after all of MMLU. Returns warnings to show once (an MMLU directory with
        some of the subjects)."""
        from data_prep.benchmark_files.layouts import (
            HUB_GSM8K_TRAIN_ROWS,
            HUB_MMLU_DEV_ROWS,
            gsm8k_split_rows,
            mmlu_split_rows,
        )

        # a caller's names (the recipe's keys) replace the flags; a field it leaves out goes by its own name
        names = dict(FLAG_NAMES) if names is None else {**{field: field for field in FLAG_NAMES}, **names}
        self._check_tasks(names, recipe=names["tasks"] != FLAG_NAMES["tasks"])
        for key, low in (("limit", 1), ("batch_size", 1), ("num_fewshot", 0), ("max_gen_toks", 1)):
            value = getattr(self, key)
            if value is not None and value < low:
                raise ValueError(f"{names[key]} {value}: must be at least {low}" + (" or unset" if key in (
                    "limit", "max_gen_toks") else ""))  # fmt: skip
        budget = self.max_gen_toks or HFLM_MAX_GEN_TOKS
        if "gsm8k" in self.tasks and positions is not None and budget >= positions:
            given = "" if self.max_gen_toks else " (lm-eval's default)"
            raise ValueError(f"{names['max_gen_toks']} {budget}{given}: the model has {positions} positions "
                             "(max_position_embeddings), and a GSM8K answer needs room for its prompt too: set it well "
                             f"below {positions}")  # fmt: skip
        pools, warnings = {}, []  # the smallest few-shot split of each task, and where it is
        if "mmlu" in self.tasks:
            splits = mmlu_split_rows(self.mmlu_dir) if self.mmlu_dir else {}
            if self.mmlu_dir:
                splits, warning = known_mmlu_subjects(splits, f"{names['mmlu_dir']} {self.mmlu_dir}")
                warnings += [warning] if warning else []
            rows = {s: r["dev"] for s, r in splits.items()} or {"every subject": HUB_MMLU_DEV_ROWS}
            smallest = min(rows, key=rows.get)
            pools["mmlu"] = (rows[smallest], f"MMLU's dev split has {rows[smallest]} rows for {smallest}")
        if "gsm8k" in self.tasks:
            splits = gsm8k_split_rows(self.gsm8k_dir) if self.gsm8k_dir else {"train": HUB_GSM8K_TRAIN_ROWS}
            train = splits["train"]
            pools["gsm8k"] = (train, f"GSM8K's train split (its few-shot examples) has {train} rows")
        for pool, where in pools.values():
            if self.num_fewshot > pool:
                raise ValueError(f"{names['num_fewshot']} {self.num_fewshot}: {where}, so at most {pool} examples "
                                 "can precede a question")  # fmt: skip
        return warnings

    def _check_tasks(self, names: dict[str, str], recipe: bool) -> None:
        """At least one task, each known, and a hub task only where the hub can be reached: offline, `datasets`
        raised a ConnectionError only after the model had loaded (a traceback; on a run's rank 0 at start-up)."""
        supported = list(SUPPORTED_TASKS)
        if not self.tasks:  # a recipe's empty list turns the benchmarks off before any check
            raise ValueError(f"{names['tasks']}: no task given; supported: {supported}, comma-separated")
        unknown = [task for task in self.tasks if task not in SUPPORTED_TASKS]
        if unknown:
            none = " (or [] for none)" if recipe else ""  # only a recipe's list may be empty
            raise ValueError(f"{names['tasks']}: {unknown} unknown; supported: {supported}{none}")
        offline = [name for name in OFFLINE_VARIABLES if os.environ.get(name, "").strip().upper() in OFFLINE_VALUES]
        for task, field in (("mmlu", "mmlu_dir"), ("gsm8k", "gsm8k_dir")):
            if offline and task in self.tasks and not getattr(self, field) and not hub_copy_cached(task):
                raise ValueError(f"{names[field]}: not set, so {task} would be read from the Hugging Face hub "
                                 f"({HUB_DATASETS[task]}, not in this machine's cache), but {offline[0]}="
                                 f"{os.environ[offline[0]]} keeps this process off the network: set {names[field]} to "
                                 f"a local copy of {task}, or leave {offline[0]} unset")  # fmt: skip

    def metadata(self) -> dict[str, str | bool]:
        """What the local tasks' loaders read (lm-eval's `--metadata`); `raise_errors`: exceptions, not an exit."""
        given = {key: value for key, value in (("mmlu_dir", self.mmlu_dir), ("gsm8k_dir", self.gsm8k_dir)) if value}
        return {**given, "raise_errors": True} if given else given


def known_mmlu_subjects(splits: dict[str, dict], where: str) -> tuple[dict[str, dict], str | None]:
    """The subjects of an MMLU directory that are MMLU's (only those are evaluated), and a warning when some of the 57
    are missing. None of them (a cais/mmlu snapshot of its `all` folder only) is refused: MMLU would not run."""
    known = {subject: rows for subject, rows in splits.items() if subject in MMLU_SUBJECTS}
    if not known:
        found = ", ".join(sorted(splits)[:5]) + (", ..." if len(splits) > 5 else "")
        raise ValueError(
            f"{where}: no MMLU subject by name (found: {found}); expected the {len(MMLU_SUBJECTS)} subjects' folders "
            f"or files ({', '.join(MMLU_SUBJECTS[:3])}, ...): a cais/mmlu snapshot needs its per-subject folders, "
            "not only all/"
        )
    if len(known) == len(MMLU_SUBJECTS):
        return known, None
    missing = [subject for subject in MMLU_SUBJECTS if subject not in known]
    return known, (
        f"{where} holds {len(known)} of the {len(MMLU_SUBJECTS)} MMLU subjects (missing: {', '.join(missing[:5])}"
        f"{', ...' if len(missing) > 5 else ''}): mmlu/acc is their accuracy weighted by size, not MMLU's"
    )


def task_names(settings: BenchmarkSettings) -> list[str]:
    """lm-eval task names: the local group when every MMLU subject is there, else the subjects present (their
    weighted accuracy is computed as the group would, see `headline_scores`); hub tasks without a directory."""
    names = []
    if "mmlu" in settings.tasks and settings.mmlu_dir:
        present = [s for s in mmlu_layout(settings.mmlu_dir)[1] if s in MMLU_SUBJECTS]
        names += ["mmlu_local"] if len(present) == len(MMLU_SUBJECTS) else [f"mmlu_local_{s}" for s in present]
    elif "mmlu" in settings.tasks:
        names.append("mmlu")
    if "gsm8k" in settings.tasks:
        names.append("gsm8k_local" if settings.gsm8k_dir else "gsm8k")
    return names


@functools.lru_cache(maxsize=4)
def task_manager(metadata: tuple[tuple[str, str], ...], hub: bool):
    """lm-eval's task index over `eval/tasks` (and its own tasks only when a hub task is asked for: indexing all
    ~27k of them costs ~8 s). It keeps the tasks it loaded: an evaluation every 1,000 steps of a run reuses them,
    their documents read and checked once (loading MMLU's 57 subjects and GSM8K costs ~1 s each time otherwise);
    lm-eval resets their few-shot seed and rebuilds their requests at every evaluation. What an evaluation writes into
    a kept task's config (`num_fewshot`, the generation's `max_gen_toks`) is undone before the next one gets it: a
    0-shot call made every later 5-shot call 0-shot (lm-eval keeps a config's 0), and a budget stayed for good."""
    from lm_eval.tasks import TaskManager

    class KeepingTaskManager(TaskManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loaded: dict[tuple, Any] = {}

        def load(self, task_list):
            if not isinstance(task_list, (list, tuple)) or not all(isinstance(t, str) for t in task_list):
                return super().load(task_list)
            key = tuple(task_list)
            if key not in self.loaded:
                self.loaded[key] = super().load(list(task_list))
            for task in self.loaded[key]["tasks"].values():
                _as_loaded(task)
            return self.loaded[key]

    return KeepingTaskManager(include_path=str(TASKS_DIR), include_defaults=hub, metadata=dict(metadata))


# The fields of a task's config that lm-eval's simple_evaluate writes at each call (set_config)
CALL_CONFIG = ("num_fewshot", "generation_kwargs")


def _as_loaded(task) -> None:
    """`task`'s CALL_CONFIG put back to what it held when it was loaded (kept on the task at its first use)."""
    loaded = task.__dict__.setdefault("_config_as_loaded", {
        field: copy.deepcopy(getattr(task.config, field, None)) for field in CALL_CONFIG})  # fmt: skip
    for field, value in loaded.items():
        setattr(task.config, field, copy.deepcopy(value))  # a copy: set_config updates generation_kwargs in place


def evaluate(model, tokenizer, settings: BenchmarkSettings, *, rank: int = 0, world_size: int = 1,
             stop_requested=None, **model_args) -> dict:  # fmt: skip
    """lm-eval's results dict (`results`, `n-samples`, `configs`, `samples` with `settings.log_samples`, `timings`) on
    rank 0, None on the others. `model` is a live transformers causal LM, or a model directory's path, which lm-eval
    loads with `model_args` (device, dtype, parallelize). `stop_requested` (a callable, asked before every forward
    pass and generation, on every rank together) ends it early with `EvaluationStopped`.

    With `world_size` > 1 (a live ZeRO-3 model) every rank must call this with the same settings: each scores its
    share of the documents with the prompts one process would build, and every forward pass is matched on every
    rank (`eval.sharded`).
    """
    import lm_eval

    lm_class, sharding = timed_lm_class(), contextlib.nullcontext()
    if world_size > 1:
        from eval.sharded import same_prompts_as_one_rank, sharded_lm_class

        lm_class = sharded_lm_class(lm_class)
        model_args = {**model_args, "rank": rank, "world_size": world_size}
    # a copy: lm-eval gives a tokenizer without a pad token one (unk or eos) in place, and the run exports its own
    tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None and not isinstance(tokenizer, str) else tokenizer
    lm = lm_class(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size, stop_requested=stop_requested,
                  add_bos_token=ADD_BOS_TOKEN, **model_args)  # fmt: skip
    if world_size > 1:
        sharding = same_prompts_as_one_rank(rank, world_size, lm.stand_in_tasks)
    gen_kwargs = {"max_gen_toks": settings.max_gen_toks} if settings.max_gen_toks is not None else None
    names = task_names(settings)
    hub = any(not name.endswith("_local") and not name.startswith("mmlu_local") for name in names)
    with sharding, _announcing_failure(lm if world_size > 1 else None):
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            num_fewshot=settings.num_fewshot,
            limit=settings.limit,
            gen_kwargs=gen_kwargs,
            log_samples=settings.log_samples,
            task_manager=task_manager(tuple(sorted(settings.metadata().items())), hub),
            bootstrap_iters=1000,
            verbosity="ERROR",
        )
    if world_size > 1:
        lm.finish()
    lengths = lm.prompt_lengths.summed_over_ranks(lm.device) if world_size > 1 else lm.prompt_lengths
    if results is None:  # lm-eval returns the results on rank 0 only
        return None
    results["timings"] = {**lm.timings, "dummy_forwards": getattr(lm, "dummy_forwards", 0)}
    results["prompt_lengths"] = dataclasses.asdict(lengths)
    return jsonable(results)


@contextlib.contextmanager
def _announcing_failure(lm):
    """A failure of this rank's own (not a stop, not another rank's) is announced to the others (`eval.sharded`)."""
    try:
        yield
    except (EvaluationStopped, FailedOnAnotherRank):
        raise
    except Exception:
        if lm is not None:
            lm.announce_failure()
        raise


def measure_prompts(settings: BenchmarkSettings, tokenizer, max_length: int,
                    trained_length: int | None = None) -> PromptLengths:  # fmt: skip
    """The configured tasks' prompts, exactly as an evaluation builds them (lm-eval's own request building, through
    a stand-in model that only counts tokens), against `max_length` positions (and `trained_length`, the rows the
    model trains on, when given). No model, a few seconds; the whole of MMLU and GSM8K take about a minute on one
    core."""
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.models.utils import normalize_gen_kwargs

    lengths = PromptLengths(max_length, trained_length=trained_length)

    def token_counts(texts: list[str]) -> dict[str, int]:
        unique = sorted(set(texts))
        # as the evaluation's model encodes them (eval.timed_lm.ADD_BOS_TOKEN: no BOS, as in training)
        encoded = tokenizer(unique, add_special_tokens=ADD_BOS_TOKEN)["input_ids"] if unique else []
        return {text: len(ids) for text, ids in zip(unique, encoded, strict=True)}

    class CountingLM(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            # MMLU's four answers share one context: each whole prompt is counted once per request, as scored
            counts = token_counts([context + continuation for context, continuation in (r.args for r in requests)])
            for request in requests:
                lengths.add(counts[request.args[0] + request.args[1]], max_length + 1)
            return [(0.0, False)] * len(requests)

        def generate_until(self, requests, disable_tqdm: bool = False):
            counts = token_counts([request.args[0] for request in requests])
            for request in requests:
                context, gen_kwargs = request.args
                budget = normalize_gen_kwargs(dict(gen_kwargs), HFLM_MAX_GEN_TOKS)["max_gen_toks"]
                lengths.add(counts[context], max_length - budget)
            return [""] * len(requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("no configured benchmark scores whole documents")

    gen_kwargs = {"max_gen_toks": settings.max_gen_toks} if settings.max_gen_toks is not None else None
    names = task_names(settings)
    hub = any(not name.endswith("_local") and not name.startswith("mmlu_local") for name in names)
    lm_eval.simple_evaluate(
        model=CountingLM(), tasks=names, num_fewshot=settings.num_fewshot, limit=settings.limit,
        gen_kwargs=gen_kwargs, task_manager=task_manager(tuple(sorted(settings.metadata().items())), hub),
        bootstrap_iters=0, verbosity="ERROR",
    )  # fmt: skip
    return lengths


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
    """Flat metrics for logging: `mmlu/acc`, `mmlu/<subject>/acc`, `gsm8k/exact_match_strict`, `..._flexible`.
    Local and hub tasks log under the same keys. Without the whole MMLU group (a directory with some subjects),
    `mmlu/acc` is the subjects' accuracy weighted by their sizes, as lm-eval's group aggregates it."""
    scores: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for task, metrics in results.get("results", {}).items():
        base = task.replace("mmlu_local", "mmlu").replace("gsm8k_local", "gsm8k")
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or "stderr" in key or "," not in key:
                continue
            metric, filter_name = key.split(",", 1)
            if base == "mmlu" and metric == "acc":
                scores["mmlu/acc"] = float(value)
            elif base.startswith("mmlu_") and metric == "acc":
                subject = base[len("mmlu_") :]
                scores[f"mmlu/{subject}/acc"] = float(value)
                sizes[subject] = results.get("n-samples", {}).get(task, {}).get("effective", 0)
            elif base == "gsm8k" and metric == "exact_match":
                scores[f"gsm8k/exact_match_{filter_name.split('-')[0]}"] = float(value)
    if "mmlu/acc" not in scores and sum(sizes.values()):
        weighted = sum(scores[f"mmlu/{subject}/acc"] * size for subject, size in sizes.items())
        scores["mmlu/acc"] = weighted / sum(sizes.values())
    return scores


def format_table(results: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(results)


def write_results(results: dict, path: str | Path) -> None:
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(results, indent=2, default=str))  # a kill leaves the old file or the new


def write_samples(samples: dict, path: str | Path) -> None:
    """lm-eval's per-document records (`log_samples`), one JSON object per line with its task."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"task": task, **jsonable(record)}) + "\n" for task, records in sorted(samples.items())
             for record in sorted(records, key=lambda r: (r["doc_id"], r.get("filter", "")))]  # fmt: skip
    atomic_write_text(path, "".join(lines))  # a kill or a full disk leaves the old file or the new, never a part

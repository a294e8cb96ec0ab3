"""MMLU and GSM8K through lm-eval's public API, on local data or the hub, for a model directory or a live model.

The local tasks are YAML files in `eval/tasks/` (`mmlu_local` and its 57 `mmlu_local_<subject>` tasks, and
`gsm8k_local`) that carry lm-eval's own MMLU and GSM8K prompts, few-shot splits and samplers, filters and metrics,
and read their documents from a local directory through `eval/tasks/loaders.py`. The standard CLI runs them too:

    lm_eval --model hf --model_args pretrained=DIR --include_path eval/tasks --tasks mmlu_local,gsm8k_local \
        --metadata '{"mmlu_dir": "/data/eval/mmlu", "gsm8k_dir": "/data/eval/gsm8k"}'

With no local directory, lm-eval's stock hub tasks (`mmlu`, `gsm8k`) are used, which needs the network.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.files import atomic_write_text
from data_prep.benchmark_files.layouts import mmlu_layout
from eval.agreement import EvaluationStopped, FailedOnAnotherRank, stopping_on_signal

logger = logging.getLogger("eval")
SUPPORTED_TASKS = ("mmlu", "gsm8k")
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
MMLU_SUBJECTS = tuple(sorted(p.stem[len("mmlu_local_") :] for p in TASKS_DIR.glob("mmlu_local_*.yaml")))


# What the user calls each BenchmarkSettings field: eval.run's flags; the training recipe passes its keys.
HFLM_MAX_GEN_TOKS = 256  # lm-eval's HF model's answer budget when none is given
FLAG_NAMES = {"tasks": "--tasks", "limit": "--limit", "num_fewshot": "--num-fewshot", "batch_size": "--batch-size",
              "max_gen_toks": "--max-gen-toks", "mmlu_dir": "--mmlu-dir"}  # fmt: skip


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

        names = {**FLAG_NAMES, **(names or {})}
        unknown = [task for task in self.tasks if task not in SUPPORTED_TASKS]
        if unknown:
            supported = list(SUPPORTED_TASKS)
            raise ValueError(f"{names['tasks']}: {unknown} unknown; supported: {supported} (or [] for none)")
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


@dataclass
class PromptLengths:
    """Benchmark prompts against the model's positions: lm-eval cuts a longer one from the left, without failing, so
    the score is then on a prompt the model never saw whole. A scoring prompt (MMLU's) may hold `max_length` + 1
    tokens (the last is predicted, not fed); a generation's context leaves room for its `max_gen_toks`."""

    max_length: int
    prompts: int = 0
    truncated: int = 0
    longest_tokens: int = 0  # of any prompt, counted as lm-eval's HF model counts it
    most_over: int = 0  # the most tokens any prompt holds beyond what it may: positions to add so none is cut

    def add(self, tokens: int, allowed: int) -> None:
        self.prompts += 1
        self.truncated += tokens > allowed
        self.longest_tokens = max(self.longest_tokens, tokens)
        self.most_over = max(self.most_over, tokens - allowed)

    def summed_over_ranks(self, device) -> PromptLengths:
        """Every rank's counts together (a collective: every rank calls it)."""
        import torch
        import torch.distributed as dist

        counts = torch.tensor([self.prompts, self.truncated], dtype=torch.int64, device=device)
        largest = torch.tensor([self.longest_tokens, self.most_over], dtype=torch.int64, device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return PromptLengths(self.max_length, *(int(value) for value in (*counts, *largest)))

    def warning(self, where: str) -> str | None:
        """The line that says prompts were cut (None: none was)."""
        if not self.truncated:
            return None
        return (
            f"{where}: {self.truncated:,} of {self.prompts:,} benchmark prompts are longer than the model's "
            f"{self.max_length:,} positions (max_position_embeddings; the longest holds {self.longest_tokens:,} "
            "tokens), and lm-eval cuts them from the left: their scores are on prompts the model never sees whole"
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
    lm-eval resets their few-shot seed and rebuilds their requests at every evaluation."""
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
            return self.loaded[key]

    return KeepingTaskManager(include_path=str(TASKS_DIR), include_defaults=hub, metadata=dict(metadata))


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
                  **model_args)  # fmt: skip
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


def measure_prompts(settings: BenchmarkSettings, tokenizer, max_length: int) -> PromptLengths:
    """The configured tasks' prompts, exactly as an evaluation builds them (lm-eval's own request building, through
    a stand-in model that only counts tokens), against `max_length` positions. No model, a few seconds; the whole
    of MMLU and GSM8K take about a minute on one core."""
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.models.utils import normalize_gen_kwargs

    lengths = PromptLengths(max_length)

    def token_counts(texts: list[str]) -> dict[str, int]:
        unique = sorted(set(texts))
        encoded = tokenizer(unique, add_special_tokens=False)["input_ids"] if unique else []
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


class TimedLM:
    """Mixed into lm-eval's HFLM (`timed_lm_class`): times its two request types, `loglikelihood_s` (MMLU's scoring)
    and `generate_until_s` (GSM8K's answers), with the number of requests of each; counts the prompts' lengths; and
    asks `stop_requested` before every forward pass and generation, so that a stop signal ends an evaluation within
    one of them (`EvaluationStopped`)."""

    def __init__(self, *args, stop_requested=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_requested = stop_requested
        self.timings = {"loglikelihood_s": 0.0, "loglikelihood_requests": 0, "generate_until_s": 0.0,
                        "generate_until_requests": 0}  # fmt: skip
        self.prompt_lengths = PromptLengths(self.max_length)

    def _loglikelihood_tokens(self, requests, *args, **kwargs):
        for _, context, continuation in requests:  # what HFLM cuts: beyond max_length + 1 tokens
            self.prompt_lengths.add(len(context) + len(continuation), self.max_length + 1)
        return super()._loglikelihood_tokens(requests, *args, **kwargs)

    def _agreed(self, flag: bool) -> bool:
        return flag  # one process: its own answer (the sharded LM asks every rank)

    def _stop_if_requested(self) -> None:
        if self.stop_requested is not None and self._agreed(bool(self.stop_requested())):
            raise EvaluationStopped("a stop signal arrived during the evaluation")

    def _model_call(self, *args, **kwargs):
        self._stop_if_requested()
        return super()._model_call(*args, **kwargs)

    def _model_generate(self, *args, **kwargs):
        if self.stop_requested is None:
            return super()._model_generate(*args, **kwargs)
        self._stop_if_requested()
        with stopping_on_signal(self.stop_requested):
            generated = super()._model_generate(*args, **kwargs)
        self._stop_if_requested()  # a cut answer is never scored: every rank stops here
        return generated

    def _timed(self, kind: str, method, requests, **kwargs):
        started = time.perf_counter()
        try:
            return method(requests, **kwargs)
        finally:
            self.timings[f"{kind}_s"] += time.perf_counter() - started
            self.timings[f"{kind}_requests"] += len(requests)

    def loglikelihood(self, requests, **kwargs):
        return self._timed("loglikelihood", super().loglikelihood, requests, **kwargs)

    def generate_until(self, requests, **kwargs):
        from lm_eval.models.utils import normalize_gen_kwargs

        for request in requests:  # what HFLM cuts: a context beyond max_length - max_gen_toks
            context, gen_kwargs = request.args
            budget = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)["max_gen_toks"]
            self.prompt_lengths.add(len(self.tok_encode(context)), self.max_length - budget)
        return self._timed("generate_until", super().generate_until, requests, **kwargs)


@functools.cache
def timed_lm_class():
    """lm-eval's HFLM with `TimedLM`."""
    from lm_eval.models.huggingface import HFLM

    return type("TimedHFLM", (TimedLM, HFLM), {})


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
    with open(path, "w") as handle:
        for task, records in sorted(samples.items()):
            for record in sorted(records, key=lambda r: (r["doc_id"], r.get("filter", ""))):
                handle.write(json.dumps({"task": task, **jsonable(record)}) + "\n")

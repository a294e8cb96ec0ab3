"""The cleaning stage as datatrove pipelines: filter, then MinHash signatures, buckets, clusters and the duplicate
filter, then `finish`, which publishes the shards and writes the report. Every stage but the clusters runs one task
per shard; each keeps its datatrove logging folder (completions, stats, logs) under `<out>/.clean/stages/<name>`,
which is what makes a rerun continue where a killed one stopped.

    <out>/.clean/filtered/<rank>.jsonl.zst      what passed the filters (removed after the report)
    <out>/.clean/minhash/{signatures,buckets}/  MinHash intermediates (removed after the report)
    <out>/.clean/minhash/clusters/              which documents to drop, and cluster sizes
    <out>/.clean/staging/<rank>.jsonl.zst       the output before it is published
    <out>/.clean/audit/<step>/<rank>.json       per-task counts and examples (data_prep.quality.cleaning.steps)
    <out>/data/<rank>.jsonl.zst                 the output: appears at once, complete
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup.minhash import (
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
)

from data_prep.quality.cleaning.config import CleanConfig
from data_prep.quality.cleaning.report import NEAR_DUPLICATES, write_clean_report
from data_prep.quality.cleaning.signatures import SignatureStep
from data_prep.quality.cleaning.steps import Audited, CorpusReader, ShardReader, shard_writer
from data_prep.quality.cleaning.words import MemoTokenizer

WORK_DIR = ".clean"
DATA_DIR = "data"
# "1": the filters and MinHash exactly as datatrove ships them, each splitting words with datatrove's tokenizer.
# Only for measuring the difference (python -m benchmarks.clean_quality --compare-speed): a run otherwise shares
# one splitter (data_prep.quality.cleaning.words), counts Gopher's n-grams faster (repetition) and simplifies MinHash's
# text faster (signatures), to the same decisions.
STOCK_ENV = "DATA_PREP_CLEAN_STOCK"


@dataclass(frozen=True)
class CleanJob:
    """What one cleaning run reads, how, and where it writes."""

    out: str
    files: tuple[str, ...]
    config: CleanConfig
    tasks: int
    text_field: str = "text"
    strict: bool = False
    skip_corrupt_files: bool = False
    keep_removed: bool = False
    preset: str | None = "web"  # the shipped config chosen (--preset), None for the user's own (--config)

    @property
    def work(self) -> Path:
        return Path(self.out) / WORK_DIR

    def folder(self, name: str) -> str:
        return str(self.work / name)


@dataclass
class Stage:
    name: str
    pipeline: list
    tasks: int


def word_splitter(language: str) -> str | MemoTokenizer:
    """What the filters and MinHash split words with: one splitter shared by all of them (its memo of chunks serves
    each), or datatrove's own tokenizer for `language` when STOCK_ENV is set."""
    return language if os.environ.get(STOCK_ENV) == "1" else MemoTokenizer(language)


def stages(job: CleanJob) -> list[Stage]:
    """The pipelines in the order they run; each stage needs the one before it complete."""
    config, work, dedup = job.config, str(job.work), job.config.dedup
    after_filters = job.folder("filtered") if dedup.enabled else job.folder("staging")
    words = word_splitter(config.language)
    fast = not isinstance(words, str)
    signature_step = SignatureStep if fast else MinhashDedupSignature
    filtering = [
        CorpusReader(list(job.files), job.text_field, job.strict, job.skip_corrupt_files, work),
        *(Audited(choice.name, choice.build(words, fast=fast), work, job.keep_removed) for choice in config.filters),
        shard_writer(after_filters),
    ]
    chosen = [Stage("filter", filtering, job.tasks)]
    if dedup.enabled:
        minhash, signatures = dedup.minhash(), job.folder("minhash/signatures")
        buckets, clusters = job.folder("minhash/buckets"), job.folder("minhash/clusters")
        duplicates = Audited(NEAR_DUPLICATES, MinhashDedupFilter(clusters), work, job.keep_removed)
        chosen += [
            Stage("signatures", [ShardReader(after_filters), signature_step(signatures, minhash, words)], job.tasks),
            Stage("buckets", [MinhashDedupBuckets(signatures, buckets, config=minhash)], dedup.num_buckets),
            Stage("clusters", [MinhashDedupCluster(buckets, clusters, minhash, save_cluster_size=True)], 1),
            Stage("dedup", [ShardReader(after_filters), duplicates, shard_writer(job.folder("staging"))], job.tasks),
        ]  # fmt: skip
    chosen.append(Stage("finish", [Finish(job)], 1))
    for index, stage in enumerate(chosen[1:], start=1):
        stage.pipeline.insert(0, AfterStages(str(job.work), [(before.name, before.tasks) for before in chosen[:index]]))
    return chosen


class AfterStages(PipelineStep):
    """First step of every stage but the first: each task of the stages before is complete. (Slurm's dependency is
    `afterany` between the arrays datatrove splits a stage of over 1001 tasks into, so a failed task of an early
    array would not stop the later stages on its own.)"""

    name = "stages before complete"
    type = "⚙ - CHECK"

    def __init__(self, work: str, before: list[tuple[str, int]]):
        super().__init__()
        self.work, self.before = work, before

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        for name, tasks in self.before:
            completions = Path(self.work) / "stages" / name / "completions"
            done = {path.name for path in completions.glob("*")} if completions.is_dir() else set()
            missing = [task for task in range(tasks) if f"{task:05d}" not in done]
            if missing:
                raise RuntimeError(f"stage {name} has unfinished tasks {missing[:10]}: run the same command again")
        return data


class Finish(PipelineStep):
    """Publishes the staged shards as `<out>/data/` in one rename, writes the report (last: its presence means the
    output is complete), then removes the large intermediates. Safe to run again after a kill at any point."""

    name = "publish and report"
    type = "💽 - WRITER"

    def __init__(self, job: CleanJob):
        super().__init__()
        self.job = job

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        out, work = Path(self.job.out), self.job.work
        staging, published = work / "staging", out / DATA_DIR
        staging.mkdir(parents=True, exist_ok=True)  # every document removed: no task wrote a shard
        if not published.exists():
            os.replace(staging, published)
        write_clean_report(self.job, sorted(str(path) for path in published.glob("*.jsonl.zst")))
        remove_intermediates(work)
        return iter(())


def remove_intermediates(work: Path) -> None:
    """The large intermediates, once the report is written (the clusters, audit counts and logs stay)."""
    for name in ("filtered", "minhash/signatures", "minhash/buckets", "scratch", "staging"):
        shutil.rmtree(work / name, ignore_errors=True)

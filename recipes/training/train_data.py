"""The training batches and the one owner of the data position.

`TrainData` hands the Trainer `gradient_accumulation_steps` micro-batches per optimizer step, counts what it
has consumed, and saves and restores that position (`state_dict` / `load_state_dict`) like any other stateful
part of the run. It also owns the rules for resuming on another world size or dataloader worker count:

- a preprocessed directory is read by a global row index (`data_prep.packing.packed_dataset`), so its position is one
  number that means the same on any number of processes, as long as the global batch stays the same;
- a raw-text stream is sharded per (rank, dataloader worker), so its position is per rank and holds only for
  the same world size and worker count; restoring it reads past the consumed rows (the stream is deterministic).
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from common.files import sha256_of
from common.process import die_with_parent
from data_prep.packing.format import MANIFEST as DATA_MANIFEST
from data_prep.packing.format import is_preprocessed
from data_prep.packing.packed_dataset import GlobalBatchSampler, PackedRows
from data_prep.packing.stream import PackedTextStream, sharding
from data_prep.parts.mixture import MixedRows
from data_prep.reading.readers import resolve_sources
from recipes.config import ConfigError, PretrainConfig

logger = logging.getLogger("pretrain")


class DataKind(enum.Enum):
    PREPROCESSED = "preprocessed"  # global row index: resumable on any world size with the same global batch
    STREAM = "stream"  # raw files tokenized on the fly: position per rank and dataloader worker


class DataPositionError(RuntimeError):
    """A saved data position that cannot be continued here; the message says why and what to do."""


def open_train_source(config: PretrainConfig, tokenizer, world: int) -> PackedRows | MixedRows | list[str]:
    """A preprocessed directory or a weighted mixture of them (each checked against this tokenizer and row
    length), or raw files."""
    if config.train_mixture is not None:
        return open_mixture(config, tokenizer, world)
    if len(config.train_files) == 1 and is_preprocessed(config.train_files[0]):
        rows = PackedRows(config.train_files[0])
        rows.check_matches(tokenizer, config.tokenizer_name_or_path, config.max_seq_length)
        if config.shuffle_train_rows:
            rows.shuffle(config.resolved_data_seed)
        logger.info("train data: %s, %d preprocessed rows, %s", config.train_files[0], len(rows), order_line(config))
        return rows
    for entry in config.train_files:
        if Path(entry).is_dir():
            raise ConfigError(
                f"train_files: {entry} is a directory without manifest.json; a preprocessing output is complete "
                "only once its manifest is written (run python -m data_prep.preprocess again to finish it), "
                "and it must be the only entry of train_files"
            )
    return resolve_sources(config.train_files, "train_files")


def open_mixture(config: PretrainConfig, tokenizer, world: int) -> MixedRows:
    sources, by_content = [], {}
    for index, entry in enumerate(config.train_mixture):
        if not is_preprocessed(entry["path"]):
            raise ConfigError(
                f"train_mixture[{index}].path {entry['path']}: not a preprocessed directory (no manifest.json); "
                "mixtures read outputs of python -m data_prep.preprocess"
            )
        content = sha256_of(Path(entry["path"]) / DATA_MANIFEST)
        if content in by_content:
            raise ConfigError(
                f"train_mixture[{index}].path {entry['path']} holds the same data as train_mixture"
                f"[{by_content[content]}] (identical manifest.json): list the data once with the summed weight"
            )
        by_content[content] = index
        rows = PackedRows(entry["path"])
        rows.check_matches(tokenizer, config.tokenizer_name_or_path, config.max_seq_length, f"train_mixture[{index}]")
        if len(rows) == 0:  # a division by zero further on, a traceback and exit 1 (requeued)
            raise ConfigError(f"train_mixture[{index}].path {entry['path']} holds no rows (its documents made less "
                              f"than one row of {config.max_seq_length} tokens): add data, or remove it")  # fmt: skip
        sources.append(rows.shuffle(config.resolved_data_seed + index) if config.shuffle_train_rows else rows)
    global_batch = config.resolved_global_batch_size(world)
    samples_wanted = config.total_steps(world) * global_batch
    weights = [entry["weight"] for entry in config.train_mixture]
    # a loss-spike rollback skips the data since the checkpoint: a repeating mixture sized to the steps alone ran
    # out that much early, each time (END_OF_DATA before the learning rate had decayed)
    rolls_back = config.loss_spike_factor is not None and config.loss_spike_action == "rollback"
    rollbacks = config.loss_spike_max_rollbacks if rolls_back else 0
    skippable = rollbacks * config.save_steps * global_batch
    mixture = MixedRows(sources, weights, config.mixture_exhausted == "repeat", samples_wanted + skippable)
    drawn = mixture.drawn(min(samples_wanted, len(mixture)))
    for entry, rows, count in zip(config.train_mixture, sources, drawn, strict=True):
        logger.info(
            "train mixture: %s, weight %g: %d rows, %d drawn over the run (%.2f epochs)",
            entry["path"], entry["weight"], len(rows), count, count / len(rows),
        )  # fmt: skip
    logger.info("train mixture: each source's rows %s", order_line(config))
    if len(mixture) < samples_wanted:
        logger.warning(
            "train mixture: a source runs out after %d samples (step %d of %d): mixture_exhausted: stop ends the run "
            "there", len(mixture), len(mixture) // global_batch, config.total_steps(world),
        )  # fmt: skip
    return mixture


def order_line(config: PretrainConfig) -> str:
    if config.shuffle_train_rows:
        return f"trained in a shuffled order (data_seed {config.resolved_data_seed}, another each epoch)"
    return "trained in corpus order (shuffle_train_rows: false)"


def passes_line(steps_per_epoch: int | None, num_epochs: int, total_steps: int, lr_at_end: float) -> tuple[int, str]:
    """What preflight says of the data against the run's steps (log level, line). A run whose data ends first stops
    there (it does not start another pass): its last step is evaluated, saved and exported. `lr_at_end` is the
    learning rate's share of its peak at that step (the schedule runs to max_steps)."""
    if steps_per_epoch is None:
        return logging.INFO, (
            f"train data: raw text, whose steps are known only once read: if it ends before step {total_steps:,}, "
            "the run stops there, its last step evaluated, saved and exported (preprocess to know in advance)"
        )
    available = steps_per_epoch * num_epochs
    if available >= total_steps:
        return logging.INFO, (
            f"train data: one pass is {steps_per_epoch:,} optimizer steps; the run's {total_steps:,} steps read "
            f"{total_steps / steps_per_epoch:.2f} of num_train_epochs {num_epochs}"
        )
    return logging.WARNING, (
        f"train data: one pass is {steps_per_epoch:,} optimizer steps, so num_train_epochs {num_epochs} gives "
        f"{available:,} of the run's {total_steps:,}: the run stops at step {available:,} (end of data), its last "
        f"step evaluated, saved and exported, with the learning rate at {100 * lr_at_end:.0f} % of its peak (the "
        f"schedule runs to step {total_steps:,}). Add data, set num_train_epochs "
        f"{-(-total_steps // steps_per_epoch)}, or set max_steps {available}"
    )


# Tests only: a dataloader worker stops producing after this many rows, to show that a stall ends the run.
STALL_AFTER_ROWS_ENV = "PRETRAIN_TEST_STALL_WORKER_AFTER_ROWS"


class DataStallError(RuntimeError):
    """The dataloader workers produced no batch within half of hang_timeout_s."""


def init_worker(worker_id: int) -> None:
    """Dataloader workers die with their rank, and leave preemption signals to it: Slurm signals every process
    of the job, and a worker dying of SIGTERM would kill the rank before it can save. Since multiprocessing stops
    workers with SIGTERM at exit, the rank kills them itself (`TrainData.close`)."""
    die_with_parent()
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)  # held back since the fork (`_epoch_iterator`)


PREEMPTION_SIGNALS = {signal.SIGTERM, signal.SIGUSR1}


class _StallAfter(IterableDataset):
    def __init__(self, inner: IterableDataset, rows: int):
        self.inner, self.rows = inner, rows

    def __iter__(self):
        for index, row in enumerate(self.inner):
            if index == self.rows:
                time.sleep(10**6)
            yield row


def build_loader(source: PackedRows | MixedRows | list[str], config: PretrainConfig, tokenizer, rank: int, world: int):
    pin_memory = config.dataloader_pin_memory and torch.cuda.is_available()
    workers = config.dataloader_num_workers
    # half the hang timeout: a stuck data source is named as such (exit 5) before the watchdog's generic hang (exit 1)
    timeout_s = config.hang_timeout_s / 2 if workers and config.hang_timeout_s else 0
    common = dict(num_workers=workers, pin_memory=pin_memory, worker_init_fn=init_worker, timeout=timeout_s)
    if isinstance(source, (PackedRows, MixedRows)):
        micro, accumulation = config.per_device_train_batch_size, config.gradient_accumulation_steps
        sampler = GlobalBatchSampler(len(source), micro, accumulation, world, rank)
        return DataLoader(source, batch_sampler=sampler, **common)
    stream = PackedTextStream(
        source, tokenizer, config.max_seq_length, rank=rank, world_size=world, text_field=config.text_field
    )
    if os.environ.get(STALL_AFTER_ROWS_ENV):
        stream = _StallAfter(stream, int(os.environ[STALL_AFTER_ROWS_ENV]))
    # Not passed to accelerator.prepare: the stream shards by rank itself, and accelerate's
    # dispatching would shard it a second time.
    return DataLoader(stream, batch_size=config.per_device_train_batch_size, drop_last=True, **common)


SHARDING_SAID = {
    "file": "",
    "record": ": every reader reads every file and keeps its own records",
    "file+record": ": the files that do not divide evenly among the readers are shared by record",
}


class TrainData:
    """Micro-batches over `num_train_epochs` passes, and the position in them (epoch, rows this rank consumed in
    it). Every method that gathers is a collective: call it on every rank."""

    def __init__(self, source: PackedRows | MixedRows | list[str], config: PretrainConfig, tokenizer, rank: int,
                 world: int):  # fmt: skip
        self.kind = DataKind.PREPROCESSED if isinstance(source, (PackedRows, MixedRows)) else DataKind.STREAM
        self.mixture = source if isinstance(source, MixedRows) else None
        self.mixture_paths = [entry["path"] for entry in config.train_mixture or []]
        self.seq_len = config.max_seq_length
        self.rank, self.world = rank, world
        self.sharding = "global index"
        if self.kind is DataKind.STREAM:
            readers = world * max(1, config.dataloader_num_workers)
            self.sharding = sharding(len(source), readers)
            logger.info(
                "train data: %d raw file(s) over %d reader(s) (ranks x dataloader workers), sharded by %s%s",
                len(source), readers, self.sharding, SHARDING_SAID[self.sharding],
            )  # fmt: skip
            if config.shuffle_train_rows:
                logger.info("train data: raw text is trained in file order (shuffle_train_rows applies to "
                            "preprocessed directories: python -m data_prep.preprocess)")  # fmt: skip
        self.num_workers = config.dataloader_num_workers
        self.micro_batch = config.per_device_train_batch_size  # raw text: workers take turns by micro-batch
        self.num_epochs = config.num_train_epochs
        self.loader = build_loader(source, config, tokenizer, rank, world)
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"train_files: {len(source)} preprocessed rows are fewer than one global batch of "
                f"{config.resolved_global_batch_size(world)} rows: add data or lower the batch"
            )
        # The position of what the Trainer has taken (saved in checkpoints), and of what has been read: one step
        # ahead after `peek`, which reads the next step's micro-batches so that the loop knows a step is the last.
        self.epoch = 0
        self.rows_consumed = 0  # in the current epoch, by this rank
        self._read_at = (0, 0)  # (epoch, rows) of the iterator
        self._ahead: tuple[list[torch.Tensor] | None, tuple[int, int]] | None = None
        # Started now, before the model is built: creating the iterator draws the workers' base seed from
        # torch's generator, so when it happens is part of what makes two runs identical.
        self._iterator = self._epoch_iterator(0)

    def _epoch_iterator(self, epoch: int):
        """The loader's iterator over `epoch`: a shuffled directory draws that epoch's permutation. (Set before the
        iterator forks its workers, which copy the dataset then: the loader must not keep persistent workers.)"""
        if isinstance(self.loader.dataset, PackedRows):
            self.loader.dataset.epoch = epoch
        # Held back while the workers start (they inherit the mask; `init_worker` ignores them, then lets them in): a
        # worker that took one before that died of it by torch's own handler, and its rank with it (exit 1)
        signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
        try:
            return iter(self.loader)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)

    @property
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps in one pass of preprocessed data (None for a raw-text stream: known only once read)."""
        sampler = getattr(self.loader, "batch_sampler", None)
        return sampler.steps_per_epoch if isinstance(sampler, GlobalBatchSampler) else None

    def take(self, count: int) -> list[torch.Tensor] | None:
        """`count` micro-batches, or None when this rank has no more data; the data position moves past them."""
        batches, position = self._read_ahead(count)
        self._ahead = None
        if batches is not None:
            self.epoch, self.rows_consumed = position
        return batches

    def peek(self, count: int) -> bool:
        """Whether `take(count)` will give a step's micro-batches, read now without moving the data position (a
        checkpoint saved before the next `take` continues with these same batches)."""
        return self._read_ahead(count)[0] is not None

    def _read_ahead(self, count: int) -> tuple[list[torch.Tensor] | None, tuple[int, int]]:
        if self._ahead is None:
            self._ahead = self._read(count)
        return self._ahead

    def _read(self, count: int) -> tuple[list[torch.Tensor] | None, tuple[int, int]]:
        epoch, rows = self._read_at
        batches = []
        while len(batches) < count:
            try:
                batch = next(self._iterator)["input_ids"]
            except RuntimeError as error:
                if "DataLoader timed out" not in str(error):
                    raise
                raise DataStallError(
                    f"rank {self.rank}: the dataloader workers produced no batch in {self.loader.timeout:.0f} s "
                    "(half of hang_timeout_s); the data source is stuck (a hung filesystem?)"
                ) from None
            except StopIteration:
                if epoch + 1 >= self.num_epochs:
                    return None, self._read_at
                epoch, rows = epoch + 1, 0
                self._iterator = self._epoch_iterator(epoch)
                continue
            rows += len(batch)
            batches.append(batch)
        self._read_at = (epoch, rows)
        return batches, self._read_at

    def mixture_tokens(self) -> dict[str, int] | None:
        """Tokens consumed so far from each mixture source, by its path as the recipe writes it (None: no mixture).
        A pure function of the global position, so it needs no collective."""
        if self.mixture is None:
            return None
        drawn = self.mixture.drawn(self.rows_consumed * self.world + self.epoch * len(self.mixture))
        return {path: count * self.seq_len for path, count in zip(self.mixture_paths, drawn, strict=True)}

    def state_dict(self) -> dict[str, Any]:
        """The position of every rank (a collective: gathers from all ranks). Preprocessed rows are addressed
        globally, and every rank has consumed the same count, so `global_rows_consumed` alone places them."""
        from accelerate.utils import gather_object

        per_rank = gather_object([{"epoch": self.epoch, "rows_consumed": self.rows_consumed}])
        return {
            "kind": self.kind.value,
            "per_rank": per_rank,
            "global_rows_consumed": per_rank[0]["rows_consumed"] * self.world,
            "world_size": self.world,
            "dataloader_num_workers": self.num_workers,
            "sharding": self.sharding,
            "micro_batch": self.micro_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was saved: the next batch is the one an uninterrupted run draws."""
        if state.get("kind") == DataKind.PREPROCESSED.value:
            self._seek(state["per_rank"][0]["epoch"], state["global_rows_consumed"] // self.world)
        else:
            mine = state["per_rank"][self.rank]
            self._read_past(mine["epoch"], mine["rows_consumed"])

    def resume_problem(self, state: dict[str, Any]) -> str | None:
        """Why a position saved by another launch cannot be continued by this one (None: it can). A preprocessed
        position holds on any world size with the same global batch, which the run's identity already pins."""
        if state.get("kind") == DataKind.PREPROCESSED.value:
            return None
        saved_world, workers = state["world_size"], state["dataloader_num_workers"]
        if saved_world != self.world:
            return (
                f"it was written by {saved_world} processes, this launch has {self.world}. The raw-text data "
                f"position is per rank and dataloader worker, so it cannot move to another world size: relaunch "
                f"on {saved_world} processes, or train from a preprocessed directory (python -m "
                "data_prep.preprocess), whose position is a global row index"
            )
        if workers != self.num_workers:
            return (
                f"it was written with dataloader_num_workers={workers}; the data position depends on it, so "
                f"resume with the same value (this launch: {self.num_workers})"
            )
        saved_micro = state.get("micro_batch", self.micro_batch)  # not recorded before: nothing to compare
        if self.num_workers > 1 and saved_micro != self.micro_batch:  # one worker, or none, reads in file order
            return (
                f"per_device_train_batch_size {saved_micro} -> {self.micro_batch}: dataloader workers take turns by "
                "micro-batch, so the raw-text position would train some rows twice and skip others; resume with "
                f"{saved_micro}, or train from a preprocessed directory"
            )
        saved_sharding = state.get("sharding", "record")  # checkpoints from before file sharding used records
        if saved_sharding != self.sharding:
            return (
                f"its raw-text position was counted with {saved_sharding} sharding, this launch shards by "
                f"{self.sharding}: the position would point at other documents. Finish the run with the code that "
                "wrote it, or train from a preprocessed directory"
            )
        return None

    def _seek(self, epoch: int, rows_consumed: int) -> None:
        """A preprocessed directory: the sampler starts at the next micro-batch."""
        sampler: GlobalBatchSampler = self.loader.batch_sampler
        if rows_consumed % sampler.micro:
            raise DataPositionError(f"data position {rows_consumed} is not a whole number of micro-batches")
        self.epoch = epoch
        sampler.start_micro_batch = rows_consumed // sampler.micro
        self._iterator = self._epoch_iterator(epoch)
        sampler.start_micro_batch = 0  # the next epoch starts at its beginning
        self.rows_consumed = rows_consumed
        self._read_at, self._ahead = (epoch, rows_consumed), None

    def _read_past(self, epoch: int, rows_consumed: int) -> None:
        """A raw-text stream is deterministic: reading past the consumed rows reproduces the exact next batch,
        at a cost that grows with the position."""
        self.epoch, self.rows_consumed = epoch, 0
        self._iterator = self._epoch_iterator(epoch)
        while self.rows_consumed < rows_consumed:
            try:
                self.rows_consumed += len(next(self._iterator)["input_ids"])
            except StopIteration:
                raise DataPositionError(
                    f"the data ended after {self.rows_consumed} rows while restoring position {rows_consumed}: "
                    "train_files changed since the checkpoint was written"
                ) from None
        self._read_at, self._ahead = (epoch, self.rows_consumed), None

    def close(self) -> None:
        """Stop the dataloader workers (they ignore SIGTERM, so multiprocessing's exit handler cannot)."""
        iterator, self._iterator = self._iterator, None
        if getattr(iterator, "_worker_pids_set", False):
            # torch watches its workers through SIGCHLD and would raise in this process when they die
            from torch.utils.data._utils import signal_handling

            signal_handling._remove_worker_pids(id(iterator))
            iterator._worker_pids_set = False
        workers = getattr(iterator, "_workers", [])
        for worker in workers:
            if worker.is_alive():
                worker.kill()
        for worker in workers:
            worker.join(timeout=10)

"""What a run carries from step to step and across a restart: its data position, its counters, and
the signals and faults that stop it."""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from data_prep.packed_dataset import GlobalBatchSampler
from recipes.checkpointing import CheckpointError


class TrainingFault(RuntimeError):
    """A fault that stops every rank (non-finite loss or gradient norm); the message says where."""


def ignore_stop_signals(worker_id: int) -> None:
    """Dataloader workers leave preemption signals to their rank: Slurm signals every process of the job,
    and a worker dying of SIGTERM would kill the rank before it can save. Since multiprocessing stops
    workers with SIGTERM at exit, the rank kills them itself (`EpochBatches.close`)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


class EpochBatches:
    """Micro-batches over `num_train_epochs` passes; its position (epoch, rows consumed in it) is
    part of the training state, and `restore` puts a fresh loader back at a saved position."""

    def __init__(self, loader: DataLoader, num_epochs: int):
        self.loader = loader
        self.num_epochs = num_epochs
        self.epoch = 0
        self.rows_consumed = 0  # in the current epoch, by this rank
        self._iterator = iter(loader)

    def take(self, count: int) -> list[torch.Tensor] | None:
        """`count` micro-batches, or None when this rank has no more data."""
        batches = []
        while len(batches) < count:
            try:
                batch = next(self._iterator)["input_ids"]
            except StopIteration:
                if self.epoch + 1 >= self.num_epochs:
                    return None
                self.epoch += 1
                self.rows_consumed = 0
                self._iterator = iter(self.loader)
                continue
            self.rows_consumed += len(batch)
            batches.append(batch)
        return batches

    def restore(self, epoch: int, rows_consumed: int) -> None:
        """Continue at a saved position. A preprocessed directory seeks (its sampler starts at the next
        micro-batch); a raw-text stream is deterministic, so reading past the consumed rows reproduces the
        exact next batch, at a cost that grows with the position."""
        self.epoch, self.rows_consumed = epoch, 0
        sampler = getattr(self.loader, "batch_sampler", None)
        if isinstance(sampler, GlobalBatchSampler):
            if rows_consumed % sampler.micro:
                raise CheckpointError(f"data position {rows_consumed} is not a whole number of micro-batches")
            sampler.start_micro_batch = rows_consumed // sampler.micro
            self._iterator = iter(self.loader)
            sampler.start_micro_batch = 0  # the next epoch starts at its beginning
            self.rows_consumed = rows_consumed
            return
        self._iterator = iter(self.loader)
        while self.rows_consumed < rows_consumed:
            try:
                self.rows_consumed += len(next(self._iterator)["input_ids"])
            except StopIteration:
                raise CheckpointError(
                    f"the data ended after {self.rows_consumed} rows while restoring position {rows_consumed}: "
                    "train_files changed since the checkpoint was written"
                ) from None

    def position(self) -> dict:
        return {"epoch": self.epoch, "rows_consumed": self.rows_consumed}

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


@dataclass
class RunState:
    """Everything besides model, optimizer and RNG that a resumed run needs to continue exactly."""

    step: int = 0
    num_tokens: int = 0
    best_eval_loss: float | None = None
    evaluations_without_improvement: int = 0
    best_checkpoint: str | None = None


class StopSignals:
    """SIGTERM / SIGUSR1 (Slurm preemption, `scancel`) set a flag; the loop agrees on it across ranks at
    the next step boundary, saves and exits, instead of dying mid-step."""

    def __init__(self):
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum


class LossSpikeRule:
    """Loss above `factor` x the running mean of the last `window` healthy steps. Spikes are kept out of the
    mean, so one bad step does not raise the bar for the next. The running mean starts empty after a restart."""

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def check(self, loss: float) -> float | None:
        """The running mean when `loss` is a spike, else None (and `loss` joins the mean)."""
        if len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.factor * mean:
                return mean
        self.recent.append(loss)
        return None

"""What a run carries from step to step and across a restart (its counters), and what stops it: the stop
reason, preemption signals, faults, and the loss-spike rule."""

from __future__ import annotations

import enum
import signal
from collections import deque
from dataclasses import asdict, dataclass


class TrainingFault(RuntimeError):
    """A fault that stops every rank (non-finite loss or gradient norm); the message says where."""


@dataclass
class RunState:
    """Everything besides model, optimizer, RNG and data position that a resumed run needs to continue exactly.
    The same on every rank."""

    step: int = 0
    num_tokens: int = 0
    best_eval_loss: float | None = None
    evaluations_without_improvement: int = 0
    best_checkpoint: str | None = None
    validation_sha256: str | None = None  # the set best_eval_loss was measured on (recipes.training.validation)
    # Over every launch, up to this step: start-up, steps, evaluations and saves (time a killed launch spent past its
    # last checkpoint is redone, and counted once). A checkpoint from before these fields starts them at 0.
    wall_seconds: float = 0.0
    launches: int = 0
    # Loss-spike rollbacks over every launch (a cap per launch let a requeued run roll back again and again). A rollback
    # keeps the count it had (the checkpoint it reloads holds an older one).
    loss_spike_rollbacks: int = 0

    def key_best_to(self, validation_sha256: str) -> str | None:
        """Keep the best loss and the patience count only if they were measured on this validation set; otherwise
        start both over (the old best checkpoint loses its protection from rotation) and say so. A checkpoint made
        before the set was recorded keeps its best: there is nothing to compare."""
        previous, self.validation_sha256 = self.validation_sha256, validation_sha256
        if previous is None or previous == validation_sha256 or self.best_eval_loss is None:
            return None
        said = (f"validation set changed since the last evaluation (sha256 {previous[:12]} -> "
                f"{validation_sha256[:12]}): early stopping and the best checkpoint start over with this one (the old "
                f"set's best was {self.best_eval_loss:.4f} at {self.best_checkpoint})")  # fmt: skip
        self.best_eval_loss, self.evaluations_without_improvement, self.best_checkpoint = None, 0, None
        return said

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class StopReason(enum.Enum):
    MAX_STEPS = "max_steps"
    END_OF_DATA = "end of data"
    STOP_SIGNAL = "stop signal (SIGTERM/SIGUSR1): saved and exited"
    EARLY_STOPPING = "early stopping"


@dataclass(frozen=True)
class Stop:
    """Why `Trainer.fit` returned; `str()` is what the log, run_summary.json and report.md say."""

    reason: StopReason
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value


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

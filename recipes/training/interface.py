"""What the Trainer and its callbacks share: one step's result, the callbacks' decisions, the loop's step window, and
the view of the Trainer a callback works with. Both import this module; neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from recipes.training.run_state import Stop


@dataclass
class StepResult:
    """What one optimizer step produced on this rank."""

    losses: list[torch.Tensor]  # one detached loss per micro-batch
    lr: float


class StepWindow:
    """Sums since the last metric line, on this rank: loss, micro-batches, tokens, and step seconds (evaluation
    and saving excluded; waiting for the next step's batches included, and also summed alone in `data_seconds`).
    `MetricLogger` reduces them over ranks and resets them."""

    def __init__(self, device):
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, micro-batches, tokens
        self.seconds = 0.0
        self.data_seconds = 0.0

    def add(self, loss: torch.Tensor, num_tokens: int) -> None:
        self.totals[0] += loss.detach().double()
        self.totals[1] += 1
        self.totals[2] += num_tokens

    def reset(self) -> None:
        self.totals.zero_()
        self.seconds = self.data_seconds = 0.0


@dataclass
class Control:
    """What the callbacks of one step decided."""

    stop: Stop | None = None
    step_undone: bool = False


class TrainerView(Protocol):
    """What a callback may use of the Trainer (`recipes.training.trainer.Trainer` is one)."""

    config: Any  # recipes.config.PretrainConfig
    accelerator: Any
    model: Any  # the DeepSpeed engine
    checkpointer: Any  # recipes.training.checkpointing.Checkpointer
    data: Any  # recipes.training.train_data.TrainData
    metrics: Any  # recipes.telemetry.metrics.MetricsWriter
    state: Any  # recipes.training.run_state.RunState
    signals: Any  # recipes.training.run_state.StopSignals: `received` is the stop signal this rank got, or None
    window: StepWindow
    total_steps: int

    @property
    def is_last_step(self) -> bool: ...

    def due(self, interval: int) -> bool: ...

    def save(self) -> Path: ...

    def load_checkpoint(self, path: Path, skip: tuple[str, ...] = ()) -> None: ...

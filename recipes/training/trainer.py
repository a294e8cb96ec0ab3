"""The training loop: a `Trainer` that owns the accelerator, model, optimizer, run state and callbacks.

`fit()` is the loop, `train_step()` one optimizer step. Everything that happens at intervals (metric logging,
the loss-spike rule, benchmarks, validation and early stopping, checkpoints, the progress bar) is a callback
(`recipes.training.callbacks`), called on every rank at the same point of every step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.collectives import any_rank, ranks_where
from common.process import local_world_size
from recipes.config import ConfigError, PretrainConfig
from recipes.telemetry.metrics import MetricsWriter
from recipes.training.attention import DocumentMasking
from recipes.training.callbacks import Callback
from recipes.training.checkpointing import Checkpointer, read_config, read_manifest
from recipes.training.interface import Control, StepResult, StepWindow
from recipes.training.model import (
    group_hyperparameters,
    hyperparameter_changes,
    replay_cpu_adam_bias_correction,
    restore_group_hyperparameters,
)
from recipes.training.run_state import RunState, Stop, StopReason, StopSignals, TrainingFault
from recipes.training.schedule import recipe_lr
from recipes.training.train_data import TrainData

if TYPE_CHECKING:
    from recipes.training.startup import Launch

logger = logging.getLogger("pretrain")


class Trainer:
    """Runs optimizer steps on every rank in lockstep; see the module docstring."""

    def __init__(self, config: PretrainConfig, accelerator, model, optimizer, *, data: TrainData,
                 checkpointer: Checkpointer, metrics: MetricsWriter, signals: StopSignals, state: RunState,
                 callbacks: list[Callback], masking: DocumentMasking, num_parameters: int):  # fmt: skip
        self.config, self.accelerator, self.model, self.optimizer = config, accelerator, model, optimizer
        self.data, self.checkpointer, self.metrics, self.signals = data, checkpointer, metrics, signals
        self.state, self.callbacks, self.masking = state, list(callbacks), masking
        self.num_parameters = num_parameters
        for callback in self.callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(f"{callback!r} is not a recipes.training.callbacks.Callback")
        world = accelerator.num_processes
        self.total_steps = config.total_steps(world)
        self.tokens_per_step = config.resolved_global_batch_size(world) * config.max_seq_length
        self.window = StepWindow(accelerator.device)
        self.data_ends = False  # the data has no step after this one (agreed by every rank)
        self.overflows = 0  # fp16 loss-scale overflows in a row (each a step DeepSpeed skipped)
        self._launch: tuple[float, float] | None = None  # (perf_counter at the launch's start, wall seconds before it)
        checkpointer.progress = self._checkpoint_io

    def _checkpoint_io(self) -> None:
        for callback in self.callbacks:
            callback.on_checkpoint_io(self)

    def begin_launch(self, started: float) -> None:
        """Count this launch, and its time from `started` (a perf_counter reading at process start) on top of the
        wall time the restored state carries."""
        self.state.launches += 1
        self._launch = (started, self.state.wall_seconds)

    def wall_seconds(self) -> float:
        """The run's wall time over all launches, up to now."""
        if self._launch is None:
            return self.state.wall_seconds
        started, before = self._launch
        return before + time.perf_counter() - started

    @property
    def is_last_step(self) -> bool:
        """max_steps reached, or the data runs out after this step: either way the step gets its evaluations,
        benchmarks and checkpoint."""
        return self.state.step == self.total_steps or self.data_ends

    def due(self, interval: int) -> bool:
        """Whether something that runs every `interval` steps (and at the last step) runs now."""
        return self.state.step % interval == 0 or self.is_last_step

    def fit(self) -> Stop:
        """Optimizer steps until max_steps, the end of the data, a stop signal or a callback's stop. Every rank
        runs the same steps and the same collectives."""
        self.model.train()
        for callback in self.callbacks:
            callback.on_train_start(self)
        stop = next(filter(None, (callback.stop_before_training(self) for callback in self.callbacks)), None)
        self.data_ends = self._data_ends()
        while stop is None:
            if self.state.step >= self.total_steps:
                stop = Stop(StopReason.MAX_STEPS)
                break
            # Ranks receive signals at different moments and hold different shares of the data: all-reduces make
            # every rank take the same decisions. The signal is agreed on before the next batches are taken, so
            # that the checkpoint it saves records the data position of the step it saves.
            (signalled,) = any_rank([self.signals.received is not None], self.accelerator.device)
            if signalled:
                if self.state.step:  # a signal during the start of a fresh run: nothing trained, nothing to save
                    self.save()
                stop = Stop(StopReason.STOP_SIGNAL)
                break
            if self.data_ends:
                stop = Stop(StopReason.END_OF_DATA, f"step {self.state.step} of max_steps {self.total_steps}")
                break
            result = self.train_step(self.data.take(self.config.gradient_accumulation_steps))
            self.data_ends = self._data_ends()  # known before the callbacks, so the last step gets its evaluations
            stop = self._step_end(result)
        for callback in self.callbacks:
            callback.on_train_end(self, stop)
        if stop.reason is StopReason.END_OF_DATA and self.state.step == 0:
            raise ConfigError(
                f"train_files: the data ended before the first optimizer step, which takes {self.tokens_per_step:,} "
                "tokens: add data, or lower the batch or max_seq_length"
            )
        return stop

    def _data_ends(self) -> bool:
        """Whether any rank's data has no further step (a collective; reads the next step's batches ahead)."""
        if self.state.step >= self.total_steps:
            return False
        started = time.perf_counter()
        has_next = self.data.peek(self.config.gradient_accumulation_steps)
        (ends,) = any_rank([not has_next], self.accelerator.device)
        # the wait for the slowest rank's loader is step time: a run held back by its data showed full speed
        waited = time.perf_counter() - started
        self.window.seconds += waited
        self.window.data_seconds += waited
        return bool(ends)

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        """One optimizer step: its learning rate, a forward and backward per micro-batch, DeepSpeed's optimizer
        step on the last. A non-finite loss on any rank stops every rank before the backward that would step."""
        started = time.perf_counter()
        lr = self.lr_for(self.state.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses = []
        for index, input_ids in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            # DeepSpeed scales the loss by 1/accumulation and steps the optimizer on the boundary.
            self.accelerator.sync_gradients = last
            input_ids = input_ids.to(self.accelerator.device, non_blocking=True)
            loss = self.model(input_ids=input_ids, labels=input_ids, **self.masking.inputs(input_ids)).loss
            losses.append(loss.detach())
            if last:
                self._stop_on_nonfinite_loss(losses)
            with fp16_floor_is_a_fault(self.state.step + 1, self.checkpointer.last):
                self.accelerator.backward(loss)  # DeepSpeed's optimizer step on the last micro-batch
            self.window.add(loss, input_ids.numel())
        self.state.step += 1
        self.state.num_tokens += self.tokens_per_step
        self.window.seconds += time.perf_counter() - started
        grad_norm = self.model.get_global_grad_norm()
        finite = grad_norm is None or math.isfinite(float(grad_norm))
        # The same norm on every rank, so every rank decides alike. DeepSpeed skips such an update in its overflow
        # check; in bf16 or fp32 a run whose gradients blew up needs a person, not another step.
        self.overflows = loss_scale_overflows(finite, self.config.fp16, self.overflows, self.state.step,
                                              self.checkpointer.last)  # fmt: skip
        return StepResult(losses=losses, lr=lr)

    def lr_for(self, step: int) -> float:
        """The learning rate of the optimizer step that has `step` completed steps before it."""
        return recipe_lr(self.config, step, self.total_steps)

    def save(self) -> Path:
        """Checkpoint this step, unless the newest checkpoint already holds it (a collective)."""
        if self.checkpointer.is_current(self.state.step):
            return self.checkpointer.last
        self.state.wall_seconds = self.wall_seconds()
        path = self.checkpointer.save(self.state.step, protected=self.state.best_checkpoint)
        for callback in self.callbacks:
            callback.on_save(self, path)
        return path

    def load_checkpoint(self, path: Path, skip: tuple[str, ...] = ()) -> None:
        """Model, optimizer, RNG states and the stateful parts not in `skip` from `path` (a collective), and
        `metrics.jsonl` cut back to its step. Resume and loss-spike rollback both come through here."""
        # a rollback restores the step, not the run's counts of launches and rollbacks
        counts = self.state.launches, self.state.loss_spike_rollbacks
        hyperparameters = group_hyperparameters(self.optimizer)  # as the recipe built them
        same_world = self.checkpointer.load(path, skip)
        if self._launch is not None:
            self.state.launches, self.state.loss_spike_rollbacks = counts
        # the recipe's, not the checkpoint's: the load puts the saved groups back whole (a lowered weight_decay was
        # ignored at the same world size, taken at the next change of it), and universal/'s loader gives every group
        # the first's; before the replay, which reads CPU Adam's own keys
        changed = hyperparameter_changes(group_hyperparameters(self.optimizer), hyperparameters)
        restore_group_hyperparameters(self.optimizer, hyperparameters)
        if changed and same_world and self.accelerator.is_main_process:
            logger.warning("resume: the recipe's optimizer settings, not %s's: %s", path.name, "; ".join(changed))
        replay_cpu_adam_bias_correction(self.optimizer)
        if not same_world:
            from accelerate.utils import set_seed

            set_seed(self.config.seed + self.state.step)
        self.metrics.truncate(after_step=self.state.step)
        self.window.reset()

    def _step_end(self, result: StepResult) -> Stop | None:
        control = Control()
        for callback in self.callbacks:
            callback.on_step_end(self, result, control)
            if control.step_undone:  # a rollback: later callbacks must not log, evaluate or save this step
                break
        return control.stop

    def _stop_on_nonfinite_loss(self, losses: list[torch.Tensor]) -> None:
        bad_ranks = ranks_where(not bool(torch.isfinite(torch.stack(losses)).all()), self.accelerator.device)
        if bad_ranks:
            raise TrainingFault(
                f"non-finite loss at step {self.state.step + 1} on rank(s) {bad_ranks}; the optimizer did not step. "
                f"Last good checkpoint: {self.checkpointer.last or 'none'}"
            )


# fp16's dynamic loss scale starts at 2^16 and DeepSpeed halves it every second overflow in a row (hysteresis 2):
# 16 in a row take it to 2^8, which a healthy run finds long before (an overflow is by design at the start and after
# each doubling of the scale); DeepSpeed itself gives up at its minimum of 1, the 18th
FP16_OVERFLOWS_IN_A_ROW = 16


@contextlib.contextmanager
def fp16_floor_is_a_fault(step: int, last_checkpoint):
    """DeepSpeed's loss scaler raises a bare Exception when the scale is at its minimum and overflows again: a training
    fault (exit 3), not a traceback (1, which the Slurm scripts requeue into the same blow-up)."""
    try:
        yield
    except Exception as error:
        if "loss scale already at minimum" not in str(error):
            raise
        raise TrainingFault(f"fp16 loss scale at its minimum and still overflowing at step {step}: stopping without "
                            f"saving. Last good checkpoint: {last_checkpoint or 'none'}") from None  # fmt: skip


def loss_scale_overflows(finite: bool, fp16: bool, overflows: int, step: int, last_checkpoint) -> int:
    """fp16 overflows in a row after this step (0 when its gradients were finite). A non-finite gradient norm is a
    training fault (TrainingFault, exit 3) in bf16 or fp32, and in fp16 once it has repeated past
    FP16_OVERFLOWS_IN_A_ROW steps; below that it is the loss scaler's business (DeepSpeed skipped the update and
    lowered the scale), logged."""
    if finite:
        return 0
    if fp16 and overflows + 1 < FP16_OVERFLOWS_IN_A_ROW:
        logger.warning("step %d: fp16 loss-scale overflow, the update was skipped and the scale lowered (%d in a row)",
                       step, overflows + 1)  # fmt: skip
        return overflows + 1
    why = f" ({overflows + 1} fp16 overflows in a row)" if fp16 else ""
    raise TrainingFault(f"non-finite gradient norm at step {step}{why}: stopping without saving. Last good "
                        f"checkpoint: {last_checkpoint or 'none'}")  # fmt: skip


def metrics_writer(config: PretrainConfig, accelerator, planned_tokens_per_s: float | None = None) -> MetricsWriter:
    """metrics.jsonl and the trackers on the main process (trackers started with the resolved recipe), and a
    Prometheus exporter on every node's local rank 0 for that node's ranks."""
    from recipes.telemetry import trackers

    trackers.start(accelerator, config.to_dict(), config.output_dir)
    exporter = None
    if config.prometheus_port is not None and accelerator.is_local_main_process:
        from recipes.telemetry.monitoring import PrometheusExporter

        per_node = local_world_size()
        node = accelerator.process_index // per_node
        ranks = list(range(node * per_node, (node + 1) * per_node))
        exporter = PrometheusExporter(config.prometheus_port, node, ranks, host=config.metrics_host)
        exporter.update({"benchmarks_running": 0})
        if planned_tokens_per_s:  # what the throughput alert compares with (monitoring/alerts.yml)
            exporter.update({"planned_tokens_per_s": planned_tokens_per_s})
    uses_trackers = accelerator.is_main_process and bool(accelerator.trackers)
    trackers_on = accelerator if uses_trackers else None
    return MetricsWriter(config.output_dir, accelerator.is_main_process, exporter, trackers_on,
                         lingers=config.prometheus_port is not None)  # fmt: skip


def build_trainer(config: PretrainConfig, launch: Launch, started: float) -> Trainer:
    """The model, the Trainer with its callbacks and checkpointer, restored from the chosen checkpoint. `started`: the
    perf_counter reading at the process's start, from which this launch's wall time counts."""
    from recipes.architecture import training_flops_per_token
    from recipes.training import resume
    from recipes.training.callbacks import callbacks_for
    from recipes.training.model import build_engine

    accelerator, inputs, run_dir = launch.accelerator, launch.inputs, Path(config.output_dir)
    validation_rows = inputs.validation_rows
    model, optimizer, num_params = build_engine(
        config, inputs.model_config, inputs.attn_implementation, launch.ds_config, accelerator, launch.universal
    )
    state = RunState()
    stateful = {"run_state": state, "data_position": launch.data}
    run_files = resume.run_files(config, inputs.identity)  # what every checkpoint records about the run
    checkpointer = Checkpointer(accelerator, model, run_dir, config.save_total_limit, run_files, stateful)
    shape = inputs.model_config
    masking = DocumentMasking.of(config.document_masking, inputs.tokenizer.eos_token_id, inputs.attn_implementation)
    flops = training_flops_per_token(num_params, shape.num_hidden_layers, config.max_seq_length, shape.hidden_size)
    callbacks = callbacks_for(
        config, flops_per_token=flops, validation_rows=validation_rows, masking=masking,
        benchmarks=inputs.benchmarks, tokenizer=inputs.tokenizer,
    )  # fmt: skip
    trainer = Trainer(
        config, accelerator, model, optimizer, data=launch.data, checkpointer=checkpointer, signals=launch.signals,
        metrics=metrics_writer(config, accelerator, inputs.predictions.get("tokens_per_s")), state=state,
        callbacks=callbacks, masking=masking, num_parameters=num_params,
    )  # fmt: skip
    if launch.resume_from:
        trainer.load_checkpoint(launch.resume_from)
        logger.info("resume: continuing from %s at step %d", launch.resume_from, state.step)
    trainer.begin_launch(started)
    trainer.metrics.write(state.step, launch_record(config, accelerator.num_processes, launch.resume_from, state.step))
    return trainer


def launch_record(config: PretrainConfig, world_size: int, resumed_from: Path | None, step: int) -> dict:
    """What metrics.jsonl records of each launch at its first step: its world size and accumulation, and the ones it
    continues from when they differ (an elastic run that lost or regained a node)."""
    record = {"world_size": world_size, "gradient_accumulation_steps": config.gradient_accumulation_steps}
    if resumed_from is not None:
        saved_world = read_manifest(resumed_from)["world_size"]
        if saved_world != world_size:
            saved = read_config(resumed_from).get("gradient_accumulation_steps")
            record |= {"previous_world_size": saved_world, "previous_gradient_accumulation_steps": saved}
            logger.warning("world size %d -> %d at step %d: gradient_accumulation_steps %s -> %d, global batch kept",
                           saved_world, world_size, step, saved,
                           config.gradient_accumulation_steps)  # fmt: skip
    return record

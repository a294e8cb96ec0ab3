"""What happens at intervals of the training loop, one class each.

Every method of a callback runs on every rank at the same point of the loop, so a callback that runs a
collective (an evaluation forward under ZeRO-3, a save, a reduction) stays in step with the other ranks.
Files are written through `trainer.metrics`, which writes on the main process only. The Trainer calls, in
the order the callbacks were given:

    stop_before_training(trainer)           before the first step: a reason not to train (a resumed run that had
                                            stopped early), or None
    on_train_start(trainer)                 before the first step
    on_step_end(trainer, result, control)   after every optimizer step; `control` can stop the run or mark the
                                            step undone (a rollback), which hides it from later callbacks
    on_checkpoint_io(trainer)               during a save or a load, between its phases and after each file hashed
    on_save(trainer, path)                  after a checkpoint is published
    on_train_end(trainer, stop)             after the last step, with the reason
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.files import atomic_write_text
from recipes.telemetry import metrics
from recipes.training.attention import DocumentMasking
from recipes.training.interface import Control, StepResult, TrainerView
from recipes.training.run_state import LossSpikeRule, Stop, StopReason
from recipes.training.validation import rows_sha256, validation_loss

if TYPE_CHECKING:
    from eval.harness import BenchmarkSettings

logger = logging.getLogger("pretrain")


class Callback:
    """Base class: every method does nothing unless overridden."""

    def stop_before_training(self, trainer: TrainerView) -> Stop | None:
        return None

    def on_train_start(self, trainer: TrainerView) -> None:
        pass

    def on_step_end(self, trainer: TrainerView, result: StepResult, control: Control) -> None:
        pass

    def on_checkpoint_io(self, trainer: TrainerView) -> None:
        pass

    def on_save(self, trainer: TrainerView, path: Path) -> None:
        pass

    def on_train_end(self, trainer: TrainerView, stop: Stop) -> None:
        pass


class LossSpikeGuard(Callback):
    """A step whose loss (mean over ranks) exceeds `factor` x the running mean is logged; with `rollback`,
    every rank reloads the last checkpoint and continues with the data after the spike, so the window between
    the checkpoint and the spike is skipped rather than trained on again."""

    def __init__(self, factor: float, window: int, action: str, max_rollbacks: int):
        self.rule = LossSpikeRule(factor, window)
        self.action, self.max_rollbacks = action, max_rollbacks

    def on_step_end(self, trainer: TrainerView, result: StepResult, control: Control) -> None:
        # One scalar all-reduce per step (a 70B step takes ~100 s).
        step_loss = trainer.accelerator.reduce(torch.stack(result.losses).double().mean(), reduction="mean").item()
        running_mean = self.rule.check(step_loss)
        if running_mean is None:
            return
        last = trainer.checkpointer.last
        act = self.action == "rollback" and last is not None and trainer.state.loss_spike_rollbacks < self.max_rollbacks
        logger.warning(
            "step %d: loss spike %.4f > %.2f x running mean %.4f; %s",
            trainer.state.step,
            step_loss,
            self.rule.factor,
            running_mean,
            f"rolling back to {last.name}, skipping the data since" if act else "logged only",
        )
        spike = {"loss_spike": step_loss, "loss_running_mean": running_mean, "loss_spike_step": trainer.state.step}
        if act:
            trainer.load_checkpoint(last, skip=("data_position",))  # every rank reloads; the data position stays
            trainer.state.loss_spike_rollbacks += 1
            spike["rolled_back_to_step"] = trainer.state.step
            control.step_undone = True
        trainer.metrics.write(trainer.state.step, spike)


class MetricLogger(Callback):
    """Every `logging_steps`: loss, lr, grad norm, tokens/s, MFU and peak memory, reduced over ranks, to the
    console, metrics.jsonl, TensorBoard and Prometheus; and the step of every published checkpoint."""

    def __init__(self, logging_steps: int, flops_per_token: float, peak_tflops_per_device: float | None):
        self.logging_steps = logging_steps
        self.flops_per_token, self.peak_tflops_per_device = flops_per_token, peak_tflops_per_device
        self.latest: dict = {}

    def on_step_end(self, trainer: TrainerView, result: StepResult, control: Control) -> None:
        if not trainer.due(self.logging_steps):
            return
        self.latest = self.window_record(trainer, result.lr)
        self.latest["num_tokens"] = trainer.state.num_tokens
        mixture_tokens = trainer.data.mixture_tokens()
        if mixture_tokens is not None:
            self.latest["mixture_tokens"] = mixture_tokens
        trainer.metrics.write(trainer.state.step, self.latest)
        trainer.window.reset()

    def window_record(self, trainer: TrainerView, lr: float) -> dict:
        """Metrics over the steps since the last log, reduced over ranks (a collective on every rank)."""
        accelerator, window = trainer.accelerator, trainer.window
        totals = accelerator.reduce(window.totals.clone(), reduction="sum")
        # every rank's peaks (one small all-gather): the max goes to the log, each rank's to Prometheus
        memory = torch.tensor(
            [[metrics.peak_host_memory_gb(), metrics.peak_gpu_memory_gb() or 0.0]], device=accelerator.device
        )
        per_rank = accelerator.gather(memory).cpu()
        # Ranks step in lockstep, so the slowest rank's time is the window's wall time; the tokens are
        # what all ranks consumed together, each counting only its own micro-batches.
        slowest = torch.tensor([window.seconds, window.data_seconds], device=accelerator.device, dtype=torch.float64)
        seconds, data_seconds = accelerator.reduce(slowest, reduction="max").tolist()
        window_tokens = int(totals[2].item())
        window_steps = int(totals[1].item()) // (trainer.config.gradient_accumulation_steps * accelerator.num_processes)
        tokens_per_s = metrics.tokens_per_second(window_tokens, seconds)
        grad_norm = trainer.model.get_global_grad_norm()
        world = accelerator.num_processes
        record = {
            "loss": totals[0].item() / totals[1].item(),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": tokens_per_s,
            "mfu": metrics.model_flops_utilization(
                tokens_per_s, self.flops_per_token, world, self.peak_tflops_per_device
            ),
            "peak_host_memory_gb": per_rank[:, 0].max().item(),
            "step_time_s": seconds / window_steps,
            "data_wait_s": data_seconds / window_steps,  # of step_time_s: the slowest rank's wait for its batches
            "peak_host_memory_gb_per_rank": per_rank[:, 0].tolist(),
        }
        if torch.cuda.is_available():
            record["peak_gpu_memory_gb"] = per_rank[:, 1].max().item()
            record["peak_gpu_memory_gb_per_rank"] = per_rank[:, 1].tolist()
        logger.info(
            "loss %.4f | lr %.3g | grad_norm %.3f | %.0f tokens/s | MFU %s | data wait %.0f%% | host %.2f GB",
            record["loss"],
            lr,
            float("nan") if record["grad_norm"] is None else record["grad_norm"],
            tokens_per_s,
            "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%",
            100 * data_seconds / seconds if seconds else 0.0,
            record["peak_host_memory_gb"],
        )
        return record

    def on_save(self, trainer: TrainerView, path: Path) -> None:
        trainer.metrics.write(trainer.state.step, {"last_checkpoint_step": trainer.state.step})
        logger.info("step %d: saved %s", trainer.state.step, path)


class Benchmarks(Callback):
    """MMLU / GSM8K through lm-eval on the live ZeRO-3 model at every `every`-th evaluation and the last step.
    Each rank scores its share (each forward gathers the shards); a failure is logged and training goes on; a stop
    signal ends the evaluation at the next forward pass, so that the loop saves.

    A launch that ends during the benchmarks (a hang ended by the watchdog, a crash inside a forward pass, a kill)
    leaves `RUNNING_MARKER` behind; the next launch skips the benchmarks of that step, once, so that a failure they
    cause (one rank out of memory on its longest prompts, say) cannot requeue the run into itself forever."""

    RUNNING_MARKER = ".benchmarks-running.json"

    def __init__(self, settings: BenchmarkSettings, tokenizer, output_dir: Path, eval_steps: int, every: int):
        self.settings, self.tokenizer, self.output_dir = settings, tokenizer, Path(output_dir)
        self.eval_steps, self.every = eval_steps, every
        self.skip_step: int | None = None

    def on_train_start(self, trainer: TrainerView) -> None:
        # read by the main process and sent to every rank (a collective): a rank that read it itself, on a node whose
        # view of the file system lags, would skip benchmarks the others run, and they would wait for it forever
        from accelerate.utils import broadcast_object_list

        marker, skip = self.output_dir / self.RUNNING_MARKER, [None]
        if trainer.accelerator.is_main_process:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                skip = [int(json.loads(marker.read_text())["step"])]
        self.skip_step = broadcast_object_list(skip)[0] if trainer.accelerator.num_processes > 1 else skip[0]
        if self.skip_step is None:
            return
        if trainer.accelerator.is_main_process:
            logger.warning(
                "the last launch ended during the benchmarks of step %d (a hang, a crash or a kill): they are "
                "skipped at step %d this time, so that what ended it cannot repeat (score that checkpoint with "
                "eval.run)", self.skip_step, self.skip_step,
            )  # fmt: skip

    def on_step_end(self, trainer: TrainerView, result: StepResult, control: Control) -> None:
        if not trainer.due(self.eval_steps):
            return
        evaluation = trainer.state.step // self.eval_steps
        if evaluation % self.every and not trainer.is_last_step:
            return
        step, marker = trainer.state.step, self.output_dir / self.RUNNING_MARKER
        if step == self.skip_step:
            if trainer.accelerator.is_main_process:
                logger.warning("step %d: benchmarks skipped (the last launch ended during them)", step)
            return
        from eval.in_loop import run_benchmarks

        if trainer.accelerator.is_main_process:
            try:  # the other ranks go on into the benchmarks: a full disk here must not leave them waiting
                atomic_write_text(marker, json.dumps({"step": step}))
            except OSError as error:
                logger.warning("step %d: %s not written (%s): should these benchmarks end the launch, the next one "
                               "runs them again", step, marker, error)  # fmt: skip
        signalled = lambda: trainer.signals.received is not None  # noqa: E731
        trainer.metrics.live({"benchmarks_running": 1})  # hours without a step: not a stuck run (alerts.yml)
        try:
            scores = run_benchmarks(trainer.model, trainer.accelerator, self.tokenizer, self.settings, step,
                                    self.output_dir, stop_requested=signalled)  # fmt: skip
        finally:
            trainer.metrics.live({"benchmarks_running": 0})
        if trainer.accelerator.is_main_process:
            marker.unlink(missing_ok=True)
        if scores:
            trainer.metrics.write(step, scores)


class Validation(Callback):
    """eval_loss every `eval_steps` (and at the last step) on every rank. A new best (any lower loss) is saved at
    once (and kept by rotation); after `patience` evaluations without an improvement larger than `threshold` (as
    transformers' EarlyStoppingCallback counts) the run stops, and a relaunch of it stays stopped. The loss is
    all-reduced, so every rank takes the same decision."""

    def __init__(self, rows: torch.Tensor, eval_steps: int, batch_size: int, masking: DocumentMasking,
                 patience: int | None, threshold: float):  # fmt: skip
        self.rows, self.eval_steps, self.batch_size, self.masking = rows, eval_steps, batch_size, masking
        self.patience, self.threshold = patience, threshold
        self.rows_sha256 = rows_sha256(rows)  # the best loss and the patience count belong to this set

    def on_step_end(self, trainer: TrainerView, result: StepResult, control: Control) -> None:
        if not trainer.due(self.eval_steps):
            return
        state = trainer.state
        eval_loss = validation_loss(trainer.model, trainer.accelerator, self.rows, self.batch_size, self.masking)
        trainer.metrics.write(state.step, {"eval_loss": eval_loss})
        logger.info("step %d: eval_loss %.4f", state.step, eval_loss)
        restarted = state.key_best_to(self.rows_sha256)  # after a resume (or a rollback) with another set
        if restarted:
            logger.warning("%s", restarted)
        first = state.best_eval_loss is None
        significant = first or eval_loss < state.best_eval_loss - self.threshold
        state.evaluations_without_improvement = 0 if significant else state.evaluations_without_improvement + 1
        if first or eval_loss < state.best_eval_loss:  # the threshold is patience's: the best is the lowest loss
            state.best_eval_loss, state.best_checkpoint = eval_loss, f"checkpoint-{state.step}"
            trainer.save()  # the best model is always on disk, and protected from rotation
        stop = self.stop_before_training(trainer)
        if stop:  # (not assigned when None: an earlier callback's stop stands)
            control.stop = stop
            trainer.save()

    def stop_before_training(self, trainer: TrainerView) -> Stop | None:
        """Early stopping, once `patience` evaluations on this validation set have not improved: at an evaluation,
        and at the start of a relaunch of a run that stopped so (a requeue after its export was cut trained on)."""
        state = trainer.state
        same_set = state.validation_sha256 in (None, self.rows_sha256)
        if not (self.patience and same_set and state.evaluations_without_improvement >= self.patience):
            return None
        return Stop(StopReason.EARLY_STOPPING, f"no eval_loss improvement larger than {self.threshold:g} in "
                    f"{state.evaluations_without_improvement} evaluations (best {state.best_eval_loss:.4f} at "
                    f"{state.best_checkpoint})")  # fmt: skip


class PeriodicCheckpoint(Callback):
    """A checkpoint every `save_steps` and at the last step (rotation keeps `save_total_limit` and the best)."""

    def __init__(self, save_steps: int):
        self.save_steps = save_steps

    def on_step_end(self, trainer: TrainerView, result: StepResult, control: Control) -> None:
        if trainer.due(self.save_steps):
            trainer.save()


class ProgressBar(Callback):
    """A tqdm bar with the latest loss and tokens/s on the main process."""

    def __init__(self, logger_callback: MetricLogger):
        self.logger_callback = logger_callback
        self.bar = None

    def on_train_start(self, trainer: TrainerView) -> None:
        from tqdm.auto import tqdm

        disable = not trainer.accelerator.is_main_process
        self.bar = tqdm(
            total=trainer.total_steps, initial=trainer.state.step, disable=disable, desc="train", unit="step"
        )

    def on_step_end(self, trainer: TrainerView, result: StepResult, control: Control) -> None:
        latest = self.logger_callback.latest
        if latest:
            self.bar.set_postfix(loss=f"{latest['loss']:.3f}", tok_s=f"{latest['tokens_per_s']:.0f}", refresh=False)
        self.bar.update(trainer.state.step - self.bar.n)  # negative after a rollback

    def on_train_end(self, trainer: TrainerView, stop: Stop) -> None:
        self.bar.close()


def callbacks_for(config, *, flops_per_token: float, validation_rows: torch.Tensor | None, masking: DocumentMasking,
                  benchmarks: BenchmarkSettings | None, tokenizer) -> list[Callback]:  # fmt: skip
    """The recipe's callbacks, in the order they run after each step: the hang watchdog first (the step is
    progress), the spike rule (a rollback hides the step from the rest), then logging, benchmarks, validation,
    checkpoints and the progress bar."""
    callbacks: list[Callback] = []
    if config.hang_timeout_s:
        callbacks.append(HangWatchdog(config.hang_timeout_s))
    if config.loss_spike_factor:
        callbacks.append(
            LossSpikeGuard(
                config.loss_spike_factor,
                config.loss_spike_window,
                config.loss_spike_action,
                config.loss_spike_max_rollbacks,
            )
        )
    metric_logger = MetricLogger(config.logging_steps, flops_per_token, config.peak_tflops_per_device)
    callbacks.append(metric_logger)
    if benchmarks is not None:
        callbacks.append(
            Benchmarks(benchmarks, tokenizer, config.output_dir, config.eval_steps, config.eval_benchmarks_every)
        )
    if validation_rows is not None:
        callbacks.append(
            Validation(
                validation_rows,
                config.eval_steps,
                config.per_device_eval_batch_size,
                masking,
                config.early_stopping_patience,
                config.early_stopping_threshold,
            )
        )
    callbacks.append(PeriodicCheckpoint(config.save_steps))
    callbacks.append(ProgressBar(metric_logger))
    return callbacks


class HangWatchdog(Callback):
    """A hang becomes an error in bounded time. Every forward pass (training, validation, benchmarks), optimizer
    step, save, and each phase and file of a save or load re-arms a `faulthandler` timer; when `timeout_s` passes
    without one, the rank writes every thread's stack to stderr ("Timeout (h:mm:ss)!") and exits with code 1, so
    that a scheduler's requeue relaunches the run instead of leaving it idle. A rank stuck in a collective stops its
    peers' forwards too, so every rank times out within seconds of the others. The timer is a C thread: it fires even
    when Python is blocked inside NCCL, gloo or a dataloader queue."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._hook = None

    def beat(self, *_) -> None:
        import faulthandler

        faulthandler.dump_traceback_later(self.timeout_s, exit=True)

    def on_train_start(self, trainer: TrainerView) -> None:
        self._hook = trainer.accelerator.unwrap_model(trainer.model).register_forward_pre_hook(self.beat)
        self.beat()
        logger.info("hang watchdog: a rank without a forward pass or step for %.0f s dumps its stacks and exits",
                    self.timeout_s)  # fmt: skip

    def on_step_end(self, trainer: TrainerView, result: StepResult, control: Control) -> None:
        self.beat()

    def on_checkpoint_io(self, trainer: TrainerView) -> None:
        # a save of ~104 GB per rank (write, sync, hash) can outlast the timeout: each file is progress. Only a running
        # timer: the resume's load comes before the first step (an elastic one reads ~840 GB per rank), untimed
        if self._hook is not None:
            self.beat()

    def on_save(self, trainer: TrainerView, path: Path) -> None:
        if self._hook is not None:  # the final save comes after on_train_end: the export after it is not timed
            self.beat()

    def on_train_end(self, trainer: TrainerView, stop: Stop) -> None:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

"""The run's model as a Hugging Face model directory."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from recipes.checkpointing import write_resolved_config
from recipes.config import PretrainConfig

if TYPE_CHECKING:
    from recipes.run_state import Stop
    from recipes.startup import Launch
    from recipes.trainer import Trainer

logger = logging.getLogger("pretrain")


def export_final(accelerator, model, tokenizer, output_dir: str | Path, config_dict) -> Path:
    """Consolidated 16-bit HF weights (safetensors), tokenizer and recipe in `output_dir/final`. A collective:
    every rank gathers its ZeRO-3 partitions; the main process writes."""
    final = Path(output_dir) / "final"
    state_dict = accelerator.get_state_dict(model)  # collective: gathers every ZeRO-3 partition
    if accelerator.is_main_process:
        final.mkdir(parents=True, exist_ok=True)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.config.use_cache = True
        unwrapped.save_pretrained(final, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(final)
        write_resolved_config(final, config_dict)
    accelerator.wait_for_everyone()
    return final


def export_run(config: PretrainConfig, launch: Launch, trainer: Trainer, stop: Stop, started: float) -> None:
    """final/ (the best checkpoint after early stopping), then the summary, report and loss plot."""
    from accelerate.utils import gather_object

    from recipes.metrics import peak_host_memory_gb, write_run_outputs
    from recipes.run_state import StopReason

    accelerator, state, run_dir = trainer.accelerator, trainer.state, Path(config.output_dir)
    if stop.reason is StopReason.EARLY_STOPPING and state.best_checkpoint:
        logger.info("exporting the best checkpoint, %s, to final/", state.best_checkpoint)
        accelerator.load_state(str(run_dir / state.best_checkpoint))  # collective
    final_dir = export_final(accelerator, trainer.model, launch.inputs.tokenizer, run_dir, config.to_dict())
    peaks = gather_object([peak_host_memory_gb()])  # a collective
    if accelerator.is_main_process:
        summary = dict(
            steps=state.step, stop_reason=str(stop), best_eval_loss=state.best_eval_loss,
            best_checkpoint=state.best_checkpoint, wall_seconds=time.perf_counter() - started,
            resumed_from=str(launch.resume_from) if launch.resume_from else None,
            num_parameters=trainer.num_parameters, peak_host_memory_gb_per_rank=peaks,
            attn_implementation=launch.inputs.attn_implementation,
        )  # fmt: skip
        write_run_outputs(run_dir, final_dir, summary)

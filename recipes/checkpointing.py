"""Checkpoints and the final export.

Every function here is called on every rank: ZeRO-3 state is sharded, so saving it and gathering
the full weights are collectives. Only the file moves and deletions are done by the main process,
between barriers.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import yaml

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
RESOLVED_CONFIG = "config.yaml"


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """Published checkpoints, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def checkpoints_to_delete(checkpoints: list[Path], save_total_limit: int | None) -> list[Path]:
    if save_total_limit is None or len(checkpoints) <= save_total_limit:
        return []
    return checkpoints[: len(checkpoints) - save_total_limit]


def write_resolved_config(directory: Path, config_dict: dict[str, Any]) -> None:
    (directory / RESOLVED_CONFIG).write_text(yaml.safe_dump(config_dict, sort_keys=False))


def save_checkpoint(accelerator, output_dir: str | Path, step: int, state: dict[str, Any], config_dict) -> Path:
    """Write `checkpoint-{step}` via a temporary directory that is renamed only once every rank is done,
    so a crash mid-save never leaves a directory that looks complete."""
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    staging = output_dir / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))  # collective: each rank writes its own ZeRO-3 shards
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (staging / TRAINER_STATE).write_text(json.dumps({"global_step": step, **state}, indent=2))
        write_resolved_config(staging, config_dict)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    accelerator.wait_for_everyone()
    return final


def rotate_checkpoints(accelerator, output_dir: str | Path, save_total_limit: int | None) -> list[Path]:
    """Delete the oldest checkpoints beyond the limit; the newest is always complete by now."""
    doomed = checkpoints_to_delete(checkpoint_dirs(output_dir), save_total_limit)
    if accelerator.is_main_process:
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()
    return doomed


def export_final(accelerator, model, tokenizer, output_dir: str | Path, config_dict) -> Path:
    """Consolidated 16-bit HF weights (safetensors), tokenizer and recipe in `output_dir/final`."""
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

"""Experiment trackers through accelerate's integration, chosen by `report_to` (as in TrainingArguments):
tensorboard (default), wandb, mlflow, or none. metrics.jsonl stays the source of truth; the trackers get the same
numbers, and the resolved recipe as the run's configuration.

A relaunch continues the same tracker run: the wandb run id and the MLflow run id are kept in
`output_dir/trackers.json`. wandb takes its project from WANDB_PROJECT, its mode from WANDB_MODE (offline works on
clusters without the internet; `wandb sync` later). MLflow writes to MLFLOW_TRACKING_URI, or, when it is unset, to a
local file store in `output_dir/mlruns`.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from common.files import atomic_write_text

PROJECT = "llama-zero3-pretrain"
IDS_FILE = "trackers.json"


def _ids(output_dir: Path) -> dict[str, str]:
    path = output_dir / IDS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def trackers_for(report_to: list[str], output_dir: str | Path) -> list:
    """accelerate tracker objects for `report_to` (constructed on every rank; they act on the main process)."""
    from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker

    output_dir = Path(output_dir)
    ids, trackers = _ids(output_dir), []
    if "tensorboard" in report_to:
        trackers.append(TensorBoardTracker("tensorboard", output_dir))  # writes output_dir/tensorboard
    if "wandb" in report_to:
        run_id = ids.get("wandb") or uuid.uuid4().hex[:16]
        trackers.append(
            WandBTracker(
                os.environ.get("WANDB_PROJECT", PROJECT),
                name=output_dir.name,
                id=run_id,
                resume="allow",
                dir=str(output_dir),
            )  # fmt: skip
        )
    if "mlflow" in report_to:
        trackers.append(MLflowTracker(PROJECT, run_id=ids.get("mlflow"), run_name=output_dir.name))
    return trackers


def start(accelerator, config_dict: dict[str, Any], output_dir: str | Path) -> None:
    """Start the trackers with the resolved recipe as their configuration, and keep their run ids (main process)."""
    if not accelerator.is_main_process or not accelerator.log_with:
        return
    output_dir = Path(output_dir)
    if any(type(t).__name__ == "MLflowTracker" for t in accelerator.log_with) and not os.environ.get(
        "MLFLOW_TRACKING_URI"
    ):
        import mlflow

        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants it for a local file store
        mlflow.set_tracking_uri(f"file:{(output_dir / 'mlruns').resolve()}")
    accelerator.init_trackers(PROJECT, config=flat(config_dict))
    ids = _ids(output_dir)
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            ids["wandb"] = tracker.run.id
        elif tracker.name == "mlflow":
            ids["mlflow"] = tracker.active_run.info.run_id
    atomic_write_text(output_dir / IDS_FILE, json.dumps(ids, indent=2))


def flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys and lists as text: what TensorBoard's hparams and MLflow's params take."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = ",".join(map(str, value))
        else:
            out[name] = value if isinstance(value, (bool, int, float, str)) else str(value)  # None -> "None"
    return out

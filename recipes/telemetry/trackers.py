"""Experiment trackers through accelerate's integration, chosen by `report_to` (as in TrainingArguments):
tensorboard (default), wandb, mlflow, or none. metrics.jsonl stays the source of truth; the trackers get the same
numbers, and the resolved recipe as the run's configuration.

A relaunch continues the same tracker run: the wandb run id and the MLflow run id are kept in
`output_dir/trackers.json`. wandb takes its project from WANDB_PROJECT, its mode from WANDB_MODE (offline works on
clusters without the internet; `wandb sync` later), its directory from WANDB_DIR (else the run's output_dir). MLflow
writes to MLFLOW_TRACKING_URI, or, when it is unset, to a local file store in `output_dir/mlruns`.

Preflight checks them before the model is built (`check_trackers`): the packages are installed, W&B online has an
API key and reaches its server, an MLflow server is reachable; each failure is one line naming the way out.
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
WANDB_STEP = "train/step"  # wandb's x axis: the run's step, logged as a value (see `log`)


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
                dir=os.environ.get("WANDB_DIR") or str(output_dir),
            )  # fmt: skip
        )
    if "mlflow" in report_to:
        trackers.append(MLflowTracker(PROJECT, run_id=ids.get("mlflow"), run_name=output_dir.name))
    return trackers


PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
REACH_TIMEOUT_S = 5.0


def check_trackers(report_to: list[str], environ: dict[str, str] | None = None) -> None:
    """Raise ConfigError (one line, naming the way out) when a tracker would fail once the model is built: its
    package missing, W&B online without an API key or without a route to its server, an MLflow server unreachable."""
    import importlib.util
    from urllib.parse import urlparse

    from recipes.config import ConfigError

    environ = os.environ if environ is None else environ
    for name in report_to:
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(f"report_to {name}: the {PACKAGES[name]} package is not installed "
                              "(pip install -e '.[trackers]')")  # fmt: skip
    if "wandb" in report_to and environ.get("WANDB_MODE", "").lower() not in ("offline", "disabled", "dryrun"):
        offline = "WANDB_MODE=offline logs to disk and `wandb sync` uploads it later"
        if not environ.get("WANDB_API_KEY") and not _netrc_has(urlparse(_wandb_url(environ)).hostname):
            raise ConfigError(f"report_to wandb: no W&B API key (WANDB_API_KEY, or `wandb login`); {offline}")
        if not reachable(_wandb_url(environ)):
            raise ConfigError(f"report_to wandb: {_wandb_url(environ)} cannot be reached from here in "
                              f"{REACH_TIMEOUT_S:g} s; {offline}")  # fmt: skip
    uri = environ.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" in report_to and uri.startswith(("http://", "https://")) and not reachable(uri):
        raise ConfigError(f"report_to mlflow: MLFLOW_TRACKING_URI {uri} cannot be reached from here in "
                          f"{REACH_TIMEOUT_S:g} s; unset it to log to output_dir/mlruns")  # fmt: skip


def _wandb_url(environ) -> str:
    return environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"


def _netrc_has(host: str | None) -> bool:
    import netrc

    try:
        return bool(host) and netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def reachable(url: str) -> bool:
    """A TCP connection to the URL's host and port opens within REACH_TIMEOUT_S."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=REACH_TIMEOUT_S):
            return True
    except OSError:
        return False


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
            chart_by_run_step(tracker.run)
        elif tracker.name == "mlflow":
            ids["mlflow"] = tracker.active_run.info.run_id
    atomic_write_text(output_dir / IDS_FILE, json.dumps(ids, indent=2))


def chart_by_run_step(run) -> None:
    """Every wandb series drawn against WANDB_STEP."""
    run.define_metric(WANDB_STEP)
    run.define_metric("*", step_metric=WANDB_STEP)


def log(trackers: list, numbers: dict[str, float], step: int) -> None:
    """`numbers` at `step` to each tracker. wandb ignores a step below its newest ("this data will be ignored"):
    after a loss-spike rollback, and after the resume of a crashed launch (which continues the same wandb run), the
    steps logged again were lost, the spike's record among them. wandb gets the step as a value instead."""
    for tracker in trackers:
        if tracker.name == "wandb":
            tracker.log({**numbers, WANDB_STEP: step})
        else:
            tracker.log(numbers, step=step)


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

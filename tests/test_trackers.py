"""`report_to` through accelerate's trackers in a real 2-process run: TensorBoard, wandb (offline) and MLflow (a
local file store) all receive the loss series that metrics.jsonl holds, and the resolved recipe as configuration."""

import glob
import json
import struct
from pathlib import Path

import pytest

from recipes.telemetry.metrics import read_metrics
from tests.conftest import LAUNCH_ENV, REPO, launch, tiny_overrides

pytestmark = pytest.mark.multiprocess


def wandb_history(path: str) -> list[dict]:
    """History records of an offline wandb run file: a ":W&B" header, then LevelDB-log records of protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, raw_records, pending, offset = 32768, [], b"", 7
    while offset + 7 <= len(data):
        left = block - offset % block
        if left < 7:  # a block's tail too short for a header is padding
            offset += left
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunk, offset = data[offset + 7 : offset + 7 + length], offset + 7 + length
        if kind in (1, 4):  # full, or last fragment
            raw_records.append(pending + chunk)
            pending = b""
        elif kind in (2, 3):  # first or middle fragment
            pending += chunk
        else:
            break
    history = []
    for raw in raw_records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return history


def test_tensorboard_wandb_and_mlflow_receive_the_loss_series(tmp_path, corpus, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output_dir = tmp_path / "run"
    env = {**LAUNCH_ENV, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": ""}
    args = tiny_overrides(corpus, output_dir, max_steps=4, logging_steps=1, eval_steps=2, save_steps=4,
                          warmup_steps=1, report_to="[tensorboard, wandb, mlflow]", max_eval_samples=8)  # fmt: skip
    result = launch(REPO / "recipes/pretrain.py", args, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    expected = {r["step"]: r["loss"] for r in read_metrics(output_dir / "metrics.jsonl") if "loss" in r}
    assert sorted(expected) == [1, 2, 3, 4]

    events = EventAccumulator(str(output_dir / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("loss")} == pytest.approx(expected, rel=1e-6)

    ids = json.loads((output_dir / "trackers.json").read_text())
    (run_file,) = glob.glob(str(output_dir / "wandb" / f"offline-run-*-{ids['wandb']}" / f"run-{ids['wandb']}.wandb"))
    wandb_losses = {h["train/step"]: h["loss"] for h in wandb_history(run_file) if "loss" in h}
    assert wandb_losses == pytest.approx(expected, rel=1e-6)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it to read a local file store
    client = MlflowClient(f"file:{output_dir / 'mlruns'}")
    history = client.get_metric_history(ids["mlflow"], "loss")
    assert {m.step: m.value for m in history} == pytest.approx(expected, rel=1e-6)
    params = client.get_run(ids["mlflow"]).data.params
    assert params["learning_rate"] == "0.003" and params["model_config.hidden_size"] == "128"


def test_wandb_keeps_the_steps_a_rollback_or_a_resume_logs_again(tmp_path, monkeypatch):
    """wandb ignores a step below its newest: the steps a loss-spike rollback (or the resume of a crashed launch,
    which continues the same wandb run) logs again were lost, the spike's own record among them. The run's step is
    a value wandb charts by now."""
    from accelerate import PartialState
    from accelerate.tracking import WandBTracker

    from recipes.telemetry import trackers

    PartialState()  # accelerate's trackers log through its state: one process here
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandBTracker("project", name="run", id="rollback0test", dir=str(tmp_path))
    tracker.start()
    trackers.chart_by_run_step(tracker.run)
    for step, loss in ((1, 4.0), (2, 3.0), (3, 9.0), (2, 3.1), (3, 2.9)):  # a spike at 3, rolled back to 2
        trackers.log([tracker], {"loss": loss}, step)
    tracker.finish()
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*-rollback0test" / "run-rollback0test.wandb"))
    logged = [(h["train/step"], h["loss"]) for h in wandb_history(run_file) if "loss" in h]
    assert logged == [(1, 4.0), (2, 3.0), (3, 9.0), (2, 3.1), (3, 2.9)]


def test_a_relaunch_continues_the_same_tracker_runs(tmp_path):
    """docs/monitoring.md: a relaunch continues the same tracker run, by the ids kept in output_dir/trackers.json."""
    from recipes.telemetry import trackers

    (tmp_path / "trackers.json").write_text(json.dumps({"wandb": "kept0wandb0id", "mlflow": "kept-mlflow-id"}))
    wandb, mlflow = trackers.trackers_for(["wandb", "mlflow"], tmp_path)
    assert wandb.init_kwargs["id"] == "kept0wandb0id" and wandb.init_kwargs["resume"] == "allow"
    assert mlflow.run_id == "kept-mlflow-id"
    fresh = trackers.trackers_for(["wandb"], tmp_path / "new")[0].init_kwargs["id"]
    assert fresh != "kept0wandb0id" and len(fresh) == 16

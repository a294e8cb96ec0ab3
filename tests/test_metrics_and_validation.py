import json

import pytest
import torch

from recipes.telemetry import metrics
from recipes.training.validation import rank_batches


def test_tokens_per_second_and_mfu():
    # 2 ranks x 8 rows x 2048 tokens in 4 s of wall time: the world's tokens once, not per rank.
    assert metrics.tokens_per_second(2 * 8 * 2048, 4.0) == 8192
    assert metrics.tokens_per_second(100, 0.0) == 0.0
    # 5,800 tokens/s at 430 GFLOP/token on 8 x 312 TFLOP/s is ~100% MFU.
    assert metrics.model_flops_utilization(5800, 430e9, 8, 312) == pytest.approx(0.999, abs=0.01)
    assert metrics.model_flops_utilization(5800, 430e9, 8, None) is None


def test_memory_readings_are_plausible():
    assert 0 < metrics.host_memory_gb() <= metrics.peak_host_memory_gb() * 1.01 + 0.01
    assert metrics.peak_gpu_memory_gb() is None or metrics.peak_gpu_memory_gb() >= 0


class RecordingTrackers:
    """Stands in for the accelerator whose trackers (TensorBoard, wandb, MLflow) were started: one tracker."""

    name = "tensorboard"

    def __init__(self):
        self.logged = []
        self.trackers = [self]

    def log(self, values, step=None):
        self.logged.append((step, values))


def test_writer_and_plot(tmp_path):
    trackers = RecordingTrackers()
    writer = metrics.MetricsWriter(tmp_path, enabled=True, trackers=trackers)
    for step in range(1, 6):
        writer.write(step, {"loss": 5.0 - step * 0.1, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0})
    writer.write(5, {"eval_loss": 4.7})
    writer.close()
    records = metrics.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5]
    assert records[-1] == {"step": 5, "eval_loss": 4.7}
    assert trackers.logged[0] == (1, {"loss": 4.9, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0})
    assert trackers.logged[-1] == (5, {"eval_loss": 4.7}), "the trackers get what metrics.jsonl gets"
    metrics.plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(records)


def test_an_overflow_steps_infinite_norm_is_written_as_strict_json(tmp_path):
    """An fp16 overflow step's gradient norm is inf: Python's json wrote `Infinity`, which strict readers refuse
    (docs/training.md: null)."""
    writer = metrics.MetricsWriter(tmp_path, enabled=True)
    writer.write(1, {"loss": 2.5, "grad_norm": float("inf"), "mfu": float("nan")})

    def refuse(word):
        raise ValueError(f"not JSON: {word}")

    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=refuse) == {"step": 1, "loss": 2.5, "grad_norm": None, "mfu": None}


def test_disabled_writer_writes_nothing(tmp_path):
    writer = metrics.MetricsWriter(tmp_path, enabled=False)
    writer.write(1, {"loss": 1.0})
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(("num_rows", "world_size", "batch_size"), [(10, 2, 3), (7, 4, 2), (1, 2, 8), (16, 2, 8)])
def test_validation_batches_cover_each_row_once_with_equal_counts(num_rows, world_size, batch_size):
    rows = torch.arange(num_rows).unsqueeze(1)
    per_rank = [list(rank_batches(rows, rank, world_size, batch_size)) for rank in range(world_size)]
    assert len({len(batches) for batches in per_rank}) == 1, "ZeRO-3 needs the same forward count on every rank"
    counted = [int(r) for batches in per_rank for batch, weight in batches if weight for r in batch]
    assert sorted(counted) == list(range(num_rows))


def test_a_torn_last_line_is_dropped_with_a_warning_not_a_failed_resume(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.9}\n{"step": 3, "lo')  # killed mid-write
    assert [r["step"] for r in metrics.read_metrics(path)] == [1, 2]
    metrics.truncate_metrics(path, after_step=2)  # what a resume at step 2 does
    assert path.read_text() == '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.9}\n'
    assert "metrics.jsonl:3 is not a metrics record" in caplog.text

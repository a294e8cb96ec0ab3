import json
import re
import urllib.request

from recipes import metrics
from recipes.monitoring import GAUGES, PREFIX, PrometheusExporter
from tests.conftest import REPO, free_port


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode()


def test_exporter_serves_the_latest_values_over_loopback():
    exporter = PrometheusExporter(free_port(), host="127.0.0.1")
    try:
        exporter.update({"step": 10, "loss": 3.5, "lr": 1e-4, "not_a_gauge": 1.0, "flag": True})
        exporter.update({"step": 20, "loss": 3.25})
        exporter.update({"benchmark_score": 0.31}, labels={"task": "mmlu", "metric": "acc"})
        text = scrape(exporter.port)
    finally:
        exporter.close()
    assert "# TYPE pretrain_loss gauge" in text
    assert re.search(r"^pretrain_step 20\.0$", text, re.M)
    assert re.search(r"^pretrain_loss 3\.25$", text, re.M)
    assert re.search(r"^pretrain_lr 0\.0001$", text, re.M)
    assert 'pretrain_benchmark_score{metric="acc",task="mmlu"} 0.31' in text
    assert "not_a_gauge" not in text and "flag" not in text


def test_metrics_writer_feeds_the_exporter(tmp_path):
    port = free_port()
    writer = metrics.MetricsWriter(tmp_path, enabled=True, prometheus_port=port)
    try:
        writer.write(5, {"loss": 4.0, "tokens_per_s": 1234.5, "mfu": 0.4})
        writer.write(5, {"last_checkpoint_step": 5})
        text = scrape(port)
    finally:
        writer.close()
    for line in (
        "pretrain_step 5.0",
        "pretrain_loss 4.0",
        "pretrain_tokens_per_s 1234.5",
        "pretrain_last_checkpoint_step 5.0",
    ):
        assert line in text


def test_grafana_dashboard_uses_only_exported_metrics():
    dashboard = json.loads((REPO / "monitoring/grafana_dashboard.json").read_text())
    used = {
        re.match(r"[a-z_]+", target["expr"]).group(0) for panel in dashboard["panels"] for target in panel["targets"]
    }
    exported = {PREFIX + key for key in GAUGES}
    assert used == exported, (used - exported, exported - used)


def test_run_report(tmp_path):
    writer = metrics.MetricsWriter(tmp_path, enabled=True)
    writer.write(10, {"loss": 5.0, "tokens_per_s": 100.0, "mfu": 0.3, "num_tokens": 1000})
    writer.write(20, {"loss": 4.0, "tokens_per_s": 120.0, "mfu": 0.35, "num_tokens": 2000})
    writer.write(20, {"eval_loss": 4.2})
    writer.close()
    (tmp_path / "run_summary.json").write_text(json.dumps({"stop_reason": "max_steps", "wall_seconds": 12.3}))
    report = metrics.run_report(tmp_path)
    assert "train loss: 5.0000 (step 10) -> 4.0000 (step 20)" in report
    assert "best eval loss: 4.2000 at step 20" in report
    assert "tokens consumed: 2,000" in report and "max_steps" in report

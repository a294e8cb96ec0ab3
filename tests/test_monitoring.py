import json
import re
import urllib.request

import pytest

from recipes.telemetry import metrics
from recipes.telemetry.monitoring import PrometheusExporter, exported_names
from tests.conftest import REPO, free_port


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode()


def test_exporter_serves_conventional_names_in_base_units_with_node_and_rank_labels():
    exporter = PrometheusExporter(free_port(), node=1, ranks=[2, 3], host="127.0.0.1")
    try:
        exporter.update({"step": 10, "loss": 3.5, "lr": 1e-4, "not_a_metric": 1.0, "flag": True})
        exporter.update({"step": 20, "loss": 3.25, "num_tokens": 81920, "step_time_s": 0.5})
        exporter.update({"peak_host_memory_gb_per_rank": [1.0, 1.5, 2.0, 2.5]})
        exporter.update({"mmlu/acc": 0.31})
        text = scrape(exporter.port)
    finally:
        exporter.close()
    assert "# TYPE pretrain_loss gauge" in text and "# TYPE pretrain_tokens_total counter" in text
    assert re.search(r'^pretrain_step\{node="1"\} 20\.0$', text, re.M)
    assert re.search(r'^pretrain_loss\{node="1"\} 3\.25$', text, re.M)
    assert re.search(r'^pretrain_learning_rate\{node="1"\} 0\.0001$', text, re.M)
    assert re.search(r'^pretrain_tokens_total\{node="1"\} 81920\.0$', text, re.M)
    assert re.search(r'^pretrain_step_duration_seconds\{node="1"\} 0\.5$', text, re.M)
    # this node's ranks only, in bytes
    assert 'pretrain_peak_host_memory_bytes{node="1",rank="2"} 2e+09' in text
    assert 'pretrain_peak_host_memory_bytes{node="1",rank="3"} 2.5e+09' in text
    assert 'rank="0"' not in text
    assert 'pretrain_benchmark_score{metric="acc",task="mmlu"} 0.31' in text
    assert "not_a_metric" not in text and "flag" not in text and "_gb" not in text


def test_metrics_writer_feeds_the_exporter(tmp_path):
    exporter = PrometheusExporter(free_port(), host="127.0.0.1")
    writer = metrics.MetricsWriter(tmp_path, enabled=True, prometheus=exporter)
    try:
        writer.write(5, {"loss": 4.0, "tokens_per_s": 1234.5, "mfu": 0.4})
        writer.write(5, {"last_checkpoint_step": 5})
        text = scrape(exporter.port)
    finally:
        writer.close()
    for line in (
        'pretrain_step{node="0"} 5.0',
        'pretrain_loss{node="0"} 4.0',
        'pretrain_tokens_per_second{node="0"} 1234.5',
        'pretrain_last_checkpoint_step{node="0"} 5.0',
    ):
        assert line in text


def test_grafana_dashboard_uses_exactly_the_exported_metrics():
    dashboard = json.loads((REPO / "monitoring/grafana_dashboard.json").read_text())
    used = {
        re.match(r"[a-z_]+", target["expr"]).group(0) for panel in dashboard["panels"] for target in panel["targets"]
    }
    exported = exported_names()
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


def test_the_alert_rules_pass_promtool():
    import shutil
    import subprocess

    from tests.conftest import REPO

    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed; .ci/run installs Debian's prometheus")
    checked = subprocess.run(["promtool", "check", "rules", str(REPO / "monitoring/alerts.yml")], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0 and "SUCCESS: 4 rules found" in checked.stdout, checked.stdout + checked.stderr

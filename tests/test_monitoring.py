import contextlib
import json
import re
import time
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
    assert "# TYPE pretrain_loss gauge" in text and "# TYPE pretrain_tokens_trained gauge" in text
    assert re.search(r'^pretrain_step\{node="1"\} 20\.0$', text, re.M)
    assert re.search(r'^pretrain_loss\{node="1"\} 3\.25$', text, re.M)
    assert re.search(r'^pretrain_learning_rate\{node="1"\} 0\.0001$', text, re.M)
    assert re.search(r'^pretrain_tokens_trained\{node="1"\} 81920\.0$', text, re.M)
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


def test_the_endpoint_serves_how_the_run_ended_before_it_goes():
    """-1 while the run lives; at the end its exit code for `linger_s`, then nothing (a crash: nothing at once)."""
    import threading

    exporter = PrometheusExporter(free_port(), host="127.0.0.1")
    writer = metrics.MetricsWriter("unused", enabled=False, prometheus=exporter)
    assert 'pretrain_run_exit_code{node="0"} -1.0' in scrape(exporter.port)
    closing = threading.Thread(target=writer.close, args=(4, 1.5))
    closing.start()
    time.sleep(0.3)
    assert 'pretrain_run_exit_code{node="0"} 4.0' in scrape(exporter.port)
    closing.join(timeout=10)
    with pytest.raises(OSError):
        scrape(exporter.port)
    crashed = PrometheusExporter(free_port(), host="127.0.0.1")
    started = time.monotonic()
    crashed.close(None, linger_s=30.0)
    assert time.monotonic() - started < 5, "a crash does not linger"


def test_grafana_dashboard_uses_exactly_the_exported_metrics():
    dashboard = json.loads((REPO / "monitoring/grafana_dashboard.json").read_text())
    used = {
        re.match(r"[a-z_]+", target["expr"]).group(0) for panel in dashboard["panels"] for target in panel["targets"]
    }
    exported = exported_names()
    assert used == exported, (used - exported, exported - used)
    # monitoring/README.md names every panel (it listed 10 of 13)
    listed = (REPO / "monitoring/README.md").read_text().split("Panels: ")[1].split(". The run's series")[0]
    names = [re.sub(r" \(.*", "", name).strip() for name in listed.replace("\n", " ").split(", ")]
    titles = [re.sub(r" \(.*", "", panel["title"]) for panel in dashboard["panels"]]
    assert names == titles


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


def test_the_alerts_tell_a_finished_run_from_a_dead_one(tmp_path):
    """Three runs whose endpoints all go at minute 10: one served exit code 0 first (finished, or saved and stopped),
    one served 3 (a non-finite loss), one was killed at -1. Evaluated by promtool's rule tests: only the killed and the
    failed one page as an endpoint down, and the failed one as a failed run (a finished run used to page as dead)."""
    import shutil

    import yaml

    from tests.conftest import REPO

    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed; .ci/run installs Debian's prometheus")
    groups = yaml.safe_load((REPO / "monitoring/alerts.yml").read_text())["groups"]
    rules = {rule["alert"]: rule for rule in groups[0]["rules"]}

    def expected(alert: str, instance: str, value: str) -> dict:
        annotations = {key: text.replace("{{ $labels.instance }}", instance).replace("{{ $value }}", value)
                       for key, text in rules[alert]["annotations"].items()}  # fmt: skip
        return {
            "exp_labels": {
                "severity": "page",
                "job": "pretrain",
                "instance": instance,
                **({"node": "0"} if alert == "PretrainRunFailed" else {}),
            },
            "exp_annotations": annotations,
        }

    series, runs = [], {"finished": "-1x9 0 _x30", "failed": "-1x9 3 _x30", "killed": "-1x10 _x30"}
    for instance, codes in runs.items():
        series.append({"series": f'up{{job="pretrain", instance="{instance}"}}', "values": "1x10 0x30"})
        series.append({"series": f'pretrain_run_exit_code{{job="pretrain", instance="{instance}", node="0"}}',
                       "values": codes})  # fmt: skip
    checks = [
        {"eval_time": "30m", "alertname": "PretrainEndpointDown",
         "exp_alerts": [expected("PretrainEndpointDown", name, "0") for name in ("failed", "killed")]},
        {"eval_time": "30m", "alertname": "PretrainRunFailed",
         "exp_alerts": [expected("PretrainRunFailed", "failed", "3")]},
        {"eval_time": "5m", "alertname": "PretrainEndpointDown", "exp_alerts": []},  # all three alive
    ]  # fmt: skip
    assert_rules_behave(tmp_path, series, checks)


def test_hours_of_benchmarks_without_a_step_are_not_a_stuck_run(tmp_path):
    """At 70B a full MMLU + GSM8K evaluation takes ~3.9 h with no optimizer step: PretrainNoOptimizerStep paged at
    every evaluation. The endpoint says when benchmarks run; a run with no step and no benchmarks still pages. Evaluated
    by promtool's rule tests."""
    import shutil

    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed; .ci/run installs Debian's prometheus")
    series = []
    for instance, running in (("evaluating", "0x60 1x240 0x180"), ("stuck", "0x480")):
        series.append({"series": f'pretrain_step{{job="pretrain", instance="{instance}"}}', "values": "1000x480"})
        series.append({"series": f'pretrain_benchmarks_running{{job="pretrain", instance="{instance}"}}',
                       "values": running})  # fmt: skip

    def paged(instance: str) -> dict:
        return {"exp_labels": {"severity": "page", "job": "pretrain", "instance": instance},
                "exp_annotations": {"summary": f"no optimizer step on {instance} for two hours",
                                    "description": "The run logged no new step for 2 h: look at its log for the "
                                                   "watchdog's stacks or a requeue loop."}}  # fmt: skip

    # benchmarks from minute 60 to 300: quiet while they run and for two hours after; no step by 460 pages too
    checks = [{"eval_time": f"{minutes}m", "alertname": "PretrainNoOptimizerStep", "exp_alerts": [paged("stuck")]}
              for minutes in (180, 290, 400)]  # fmt: skip
    checks.append({"eval_time": "460m", "alertname": "PretrainNoOptimizerStep",
                   "exp_alerts": [paged("evaluating"), paged("stuck")]})  # fmt: skip
    assert_rules_behave(tmp_path, series, checks)


def assert_rules_behave(tmp_path, series: list[dict], checks: list[dict]) -> None:
    """promtool's rule unit test of monitoring/alerts.yml: `series` scraped every minute, `checks` its alert tests."""
    import subprocess

    import yaml

    from tests.conftest import REPO

    unit = {"rule_files": [str(REPO / "monitoring/alerts.yml")], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}]}  # fmt: skip
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(unit))
    tested = subprocess.run(["promtool", "test", "rules", str(tmp_path / "alerts_test.yml")], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_rank_waits_while_the_exit_code_is_served_and_a_crash_does_not():
    """Only a node's first rank serves the endpoint; a rank without it exited at once with its 2-5, and the launcher
    then ended the serving rank before any scrape saw the code."""
    writer = metrics.MetricsWriter("unused", enabled=False, lingers=True)
    started = time.monotonic()
    writer.close(4, 0.5)
    assert time.monotonic() - started >= 0.5
    started = time.monotonic()
    writer.close(None, 30.0)
    assert time.monotonic() - started < 5


@pytest.mark.multiprocess
def test_a_launch_refused_at_its_start_serves_exit_code_2_before_it_goes(tmp_path, corpus):
    """A refusal at start-up (exit 2) served nothing: the first launch's endpoint looked like a lost node's
    (PretrainEndpointDown), and a requeued start's showed nothing at all (its last value was the previous 0)."""
    import subprocess

    from common.lock import LOCK_FILE, held_by_someone
    from tests.conftest import launch_command, start, tiny_overrides

    port = free_port()
    args = tiny_overrides(corpus, tmp_path / "run", train_files=tmp_path / "gone.jsonl")
    process = start(launch_command(REPO / "recipes/pretrain.py", [*args, "--prometheus_port", str(port),
                                                                  "--metrics_linger_s", "4"]),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    served, locked_while_served = set(), []
    while process.poll() is None:
        with contextlib.suppress(OSError):  # before the endpoint is up
            served |= set(re.findall(r'pretrain_run_exit_code\{node="0"\} (\S+)', scrape(port)))
            if served:  # the output_dir lock is let go first: a corrected relaunch meanwhile is not refused
                locked_while_served.append(held_by_someone(tmp_path / "run" / LOCK_FILE))
        time.sleep(0.3)
    stderr = process.communicate()[1]
    assert process.returncode != 0 and stderr.count("error: train_files") == 1, stderr[-3000:]
    assert served == {"2.0"}, stderr[-3000:]
    assert locked_while_served and not any(locked_while_served)

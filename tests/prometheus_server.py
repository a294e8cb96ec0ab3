"""A real Prometheus server for the tests (Debian's `prometheus`, installed by .ci/run): it scrapes a live run's
/metrics endpoint every second and evaluates monitoring/alerts.yml, and its HTTP API answers the queries the
Grafana dashboard makes. `why_not()` says why it cannot run here, for a skip."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tests.conftest import REPO, free_port

ALERTS = REPO / "monitoring/alerts.yml"
DASHBOARD = REPO / "monitoring/grafana_dashboard.json"


def why_not() -> str | None:
    missing = [tool for tool in ("prometheus", "promtool") if shutil.which(tool) is None]
    return f"{', '.join(missing)} not installed; .ci/run installs Debian's prometheus" if missing else None


def panel_queries(job: str = "pretrain") -> dict[str, str]:
    """Every target expression of the dashboard, with its `$job` variable filled in, by panel title and index."""
    dashboard = json.loads(DASHBOARD.read_text())
    return {f"{panel['title']} #{i}": target["expr"].replace("$job", job) for panel in dashboard["panels"]
            for i, target in enumerate(panel.get("targets", []))}  # fmt: skip


class Prometheus:
    """`with Prometheus(tmp_path, "127.0.0.1:9555") as server:` scrapes that target as job `pretrain`."""

    def __init__(self, root: Path, target: str):
        self.root, self.target, self.port = root, target, free_port()
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: ['{ALERTS}']\n"
            f"scrape_configs: [{{job_name: pretrain, static_configs: [{{targets: ['{self.target}']}}]}}]\n"
        )
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={self.root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(self.root / "prometheus.log", "w"),
        )  # fmt: skip
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                self.api("status/buildinfo")
                return self
            except OSError:
                assert self.process.poll() is None, (self.root / "prometheus.log").read_text()[-2000:]
                time.sleep(0.2)
        raise AssertionError("prometheus did not start: " + (self.root / "prometheus.log").read_text()[-2000:])

    def __exit__(self, *_) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)

    def api(self, path: str, **params) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/{path}{query}", timeout=5) as response:
            return json.loads(response.read())["data"]

    def series(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def rules(self) -> list[dict]:
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

"""Opt-in Prometheus endpoint on the main process: the latest value of each run metric as a gauge.

Plain `http.server` in a daemon thread, text exposition format 0.0.4: no extra dependency, and
nothing runs unless `prometheus_port` is set. Scrape `http://<head node>:<port>/metrics`.
"""

from __future__ import annotations

import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PREFIX = "pretrain_"
# Record keys exported, with their help text. Anything else in a record stays in metrics.jsonl only.
GAUGES = {
    "step": "optimizer steps completed",
    "loss": "training loss, mean over accumulation and ranks since the last log",
    "lr": "learning rate of the last optimizer step",
    "grad_norm": "global gradient norm before clipping",
    "tokens_per_s": "tokens consumed by all ranks per second of step time",
    "mfu": "model FLOPs utilisation",
    "peak_gpu_memory_gb": "peak CUDA memory allocated, max over ranks",
    "peak_host_memory_gb": "peak resident host memory, max over ranks",
    "num_tokens": "tokens consumed so far by all ranks",
    "eval_loss": "validation loss",
    "last_checkpoint_step": "step of the newest complete checkpoint",
    "benchmark_score": "benchmark score, by task and metric",
}


class PrometheusExporter:
    def __init__(self, port: int, host: str = "0.0.0.0"):
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = exporter.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="prometheus")
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def update(self, values: dict, labels: dict[str, str] | None = None) -> None:
        label_items = tuple(sorted((labels or {}).items()))
        with self._lock:
            for key, value in values.items():
                if key in GAUGES and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._values[(key, label_items)] = float(value)

    def render(self) -> str:
        with self._lock:
            items = sorted(self._values.items())
        lines, seen = [], set()
        for (key, labels), value in items:
            name = PREFIX + key
            if name not in seen:
                lines += [f"# HELP {name} {GAUGES[key]}", f"# TYPE {name} gauge"]
                seen.add(name)
            label_text = "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""
            text = "NaN" if math.isnan(value) else repr(value)
            lines.append(f"{name}{label_text} {text}")
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

"""Prometheus metrics of a run, through prometheus_client.

Every node's local rank 0 serves `/metrics` on `prometheus_port` (scrape `node:port` for every node): the run's
metrics, the same on every node, labelled with the node; and the per-rank values of that node's ranks (peak host
and GPU memory), labelled with rank and node. Names follow Prometheus's conventions: base units (`_bytes`,
`_seconds`, `_ratio`) and `_total` for counters. Nothing runs unless `prometheus_port` is set.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

PREFIX = "pretrain_"
DEFAULT_PORT = 9555  # not 9400: dcgm-exporter's default, which a GPU cluster with DCGM already serves


@dataclass(frozen=True)
class Series:
    name: str  # without PREFIX; a counter's name without `_total`
    kind: str  # "gauge" or "counter"
    help: str
    scale: float = 1.0  # record value x scale = base unit


# Record keys (as in metrics.jsonl) -> exported series. Anything else stays in metrics.jsonl only.
RUN_SERIES = {
    "step": Series("step", "gauge", "optimizer steps completed"),
    "loss": Series("loss", "gauge", "training loss, mean over accumulation and ranks since the last log"),
    "lr": Series("learning_rate", "gauge", "learning rate of the last optimizer step"),
    "grad_norm": Series("grad_norm", "gauge", "global gradient norm before clipping"),
    "tokens_per_s": Series("tokens_per_second", "gauge", "tokens consumed by all ranks per second of step time"),
    "mfu": Series("model_flops_utilization_ratio", "gauge", "model FLOPs utilisation (0-1)"),
    "step_time_s": Series("step_duration_seconds", "gauge", "seconds per optimizer step, slowest rank"),
    # a gauge: a loss-spike rollback takes it back (a counter that falls reads as a reset to rate())
    "num_tokens": Series("tokens_trained", "gauge", "tokens in the optimizer steps the run holds, all ranks"),
    "eval_loss": Series("eval_loss", "gauge", "validation loss"),
    "last_checkpoint_step": Series("last_checkpoint_step", "gauge", "step of the newest complete checkpoint"),
    "planned_tokens_per_s": Series("planned_tokens_per_second", "gauge", "tokens/s the planner expects of this launch"),
    "world_size": Series("world_size", "gauge", "processes (ranks) of this launch; an elastic run changes it"),
    # set around the in-loop benchmarks (hours at 70B, no optimizer step meanwhile: monitoring/alerts.yml reads it)
    "benchmarks_running": Series("benchmarks_running", "gauge", "1 while the in-loop benchmarks run, else 0"),
    # -1 while the run lives; its rank exit code once it ends (0: finished, or saved and stopped by a signal), served
    # for `metrics_linger_s` more so that Prometheus scrapes it: an endpoint that went down after 0 is a run that
    # ended, one that went down at -1 is a run that died (monitoring/alerts.yml tells them apart with it).
    "exit_code": Series("run_exit_code", "gauge", "-1 while the run lives, then the exit code it ended with"),
}
BENCHMARK_SERIES = Series("benchmark_score", "gauge", "benchmark score by task and metric")
RANK_SERIES = {
    "peak_host_memory_gb_per_rank": Series("peak_host_memory_bytes", "gauge", "peak resident host memory", 1e9),
    "peak_gpu_memory_gb_per_rank": Series("peak_gpu_memory_bytes", "gauge", "peak CUDA memory allocated", 1e9),
}


def exported_names() -> set[str]:
    """Every series name as a scrape shows it (what the Grafana dashboard may use)."""
    series = [*RUN_SERIES.values(), BENCHMARK_SERIES, *RANK_SERIES.values()]
    return {PREFIX + s.name + ("_total" if s.kind == "counter" else "") for s in series}


class RunCollector:
    """A prometheus_client collector over the latest values: what a scrape sees is what was last logged."""

    def __init__(self, node: int, ranks: list[int]):
        self.node, self.ranks = str(node), ranks
        self._values: dict[str, float] = {}
        self._benchmarks: dict[tuple[str, str], float] = {}
        self._per_rank: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def update(self, record: dict) -> None:
        with self._lock:
            for key, value in record.items():
                if key in RUN_SERIES and _is_number(value):
                    self._values[key] = float(value)
                elif key in RANK_SERIES and isinstance(value, list):
                    self._per_rank[key] = [float(v) for v in value]
                elif key.count("/") == 1 and _is_number(value):  # "mmlu/acc", "gsm8k/exact_match_strict"
                    self._benchmarks[tuple(key.split("/"))] = float(value)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            values, benchmarks, per_rank = dict(self._values), dict(self._benchmarks), dict(self._per_rank)
        for key, value in values.items():
            series = RUN_SERIES[key]
            family = (CounterMetricFamily if series.kind == "counter" else GaugeMetricFamily)(
                PREFIX + series.name, series.help, labels=["node"]
            )
            family.add_metric([self.node], value * series.scale)
            yield family
        if benchmarks:
            family = GaugeMetricFamily(PREFIX + BENCHMARK_SERIES.name, BENCHMARK_SERIES.help, labels=["task", "metric"])
            for (task, metric), value in sorted(benchmarks.items()):
                family.add_metric([task, metric], value)
            yield family
        for key, values_by_rank in per_rank.items():
            series = RANK_SERIES[key]
            family = GaugeMetricFamily(PREFIX + series.name, series.help, labels=["rank", "node"])
            for rank in self.ranks:
                if rank < len(values_by_rank):
                    family.add_metric([str(rank), self.node], values_by_rank[rank] * series.scale)
            yield family


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class PrometheusExporter:
    """`/metrics` on `port` from a registry of its own (no Python process metrics mixed in)."""

    def __init__(self, port: int, node: int = 0, ranks: list[int] | None = None, host: str = "127.0.0.1"):
        from prometheus_client import CollectorRegistry, start_http_server

        self.collector = RunCollector(node, ranks if ranks is not None else [0])
        registry = CollectorRegistry()
        registry.register(self.collector)
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.update({"exit_code": -1})

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def update(self, record: dict) -> None:
        self.collector.update(record)

    def close(self, exit_code: int | None = None, linger_s: float = 0.0) -> None:
        """Stop serving; with `exit_code`, serve it for `linger_s` seconds first (a scrape or two). Without one (a
        crash), stop at once: the endpoint goes at -1, as a dead run's does."""
        if exit_code is not None:
            self.update({"exit_code": exit_code})
            time.sleep(max(linger_s, 0.0))
        self._server.shutdown()
        self._server.server_close()


def serve_exit_code(port: int, host: str, code: int, linger_s: float) -> None:
    """What a launch refused at its start (exit 2: the recipe, an input, a checkpoint) serves before it goes, as a
    run's end does: without it a first launch's endpoint looked like a lost node's, and a requeued one's showed
    nothing (its last value was the previous launch's 0). Every rank waits `linger_s`: one exiting first makes the
    launcher end the others, the serving one too. A port that cannot be bound (the refusal may be that) is skipped."""
    exporter = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        node = int(os.environ.get("GROUP_RANK", "0"))  # torchrun's node rank
        try:
            exporter = PrometheusExporter(port, node, ranks=[], host=host)
        except OSError:
            exporter = None
    if exporter is not None:
        exporter.close(code, linger_s)
    else:
        time.sleep(max(linger_s, 0.0))

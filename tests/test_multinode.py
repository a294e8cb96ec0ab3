"""Two "machines" on loopback, one CPU process each, through the real multi-node path of
accelerate_configs/zero3_16gpu.yaml (standard launcher, machine rank and head address at launch)."""

import json
import subprocess
import sys

import pytest

from recipes.telemetry.metrics import read_metrics
from tests.conftest import REPO, data_position, free_port, start, tiny_overrides

pytestmark = pytest.mark.multiprocess


def test_two_machines_on_loopback_train_save_and_export(tmp_path, corpus):
    port = free_port()
    args = tiny_overrides(
        corpus, tmp_path, max_steps=6, logging_steps=2, eval_steps=6, save_steps=3, max_eval_samples=8
    )
    machines = []
    for machine_rank in (0, 1):
        command = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(REPO / "accelerate_configs/zero3_16gpu.yaml"),
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(machine_rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
            str(REPO / "recipes/pretrain.py"), *args,
        ]  # fmt: skip
        machines.append(start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [machine.communicate(timeout=600) for machine in machines]
    for machine, (_, stderr) in zip(machines, outputs, strict=True):
        assert machine.returncode == 0, stderr[-4000:]
    log = outputs[0][1]
    assert "on 2 processes / 2 node(s)" in log, "each machine runs one of the two ranks"
    manifest = json.loads((tmp_path / "checkpoint-6" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and len(data_position(tmp_path / "checkpoint-6")["per_rank"]) == 2
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r] == [2, 4, 6]
    assert (tmp_path / "final" / "model.safetensors").exists()

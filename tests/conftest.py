"""Shared fixtures: a real-text corpus and a tokenizer made here (no network), and a launcher for
real multi-process DeepSpeed runs on the CPU."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CPU_ACCELERATE_CONFIG = REPO / "accelerate_configs" / "zero3_cpu.yaml"
TINY_RECIPE = REPO / "recipes" / "configs" / "tiny_cpu.yaml"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Python standard-library sources as jsonl (1.5 MB train, 0.2 MB validation) and a 1024-token BPE."""
    from data_prep import demo_corpus
    from data_prep.train_tokenizer import main as train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    demo_corpus.build(root / "data", train_bytes=1_500_000, validation_bytes=200_000)
    train_tokenizer(
        ["--input", str(root / "data" / "train.jsonl"), "--vocab-size", "1024", "--output", str(root / "tokenizer")]
    )
    return {
        "train": root / "data" / "train.jsonl",
        "validation": root / "data" / "validation.jsonl",
        "tokenizer": root / "tokenizer",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(script: str | Path, args: list[str], num_processes: int = 2) -> list[str]:
    """`accelerate launch` with the CPU ZeRO-3 config on a free port."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CPU_ACCELERATE_CONFIG),
        "--num_processes",
        str(num_processes),
        "--main_process_port",
        str(free_port()),
        str(script),
        *args,
    ]


LAUNCH_ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}


def start(command: list[str], **kwargs) -> subprocess.Popen:
    """A launch in a session of its own, so that killing its group reaches every rank and worker."""
    return subprocess.Popen(command, cwd=REPO, env=LAUNCH_ENV, text=True, start_new_session=True, **kwargs)


def launch(script: str | Path, args: list[str], num_processes: int = 2, timeout_s: int = 600):
    """Run a launch to the end; returns the finished process (output captured). A hung run is killed whole."""
    command = launch_command(script, args, num_processes)
    process = start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"timed out after {timeout_s} s:\n{stderr[-4000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def tiny_overrides(corpus: dict[str, Path], output_dir: Path, **extra) -> list[str]:
    values = {
        "output_dir": output_dir,
        "tokenizer_name_or_path": corpus["tokenizer"],
        "train_files": corpus["train"],
        "validation_files": corpus["validation"],
        "eval_tasks": "[]",  # benchmarks cost ~10 s per evaluation; the tests that check them turn them on
        **extra,
    }
    args = ["--config", str(TINY_RECIPE)]
    for key, value in values.items():
        args += [f"--{key}", str(value)]
    return args

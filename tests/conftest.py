"""Shared fixtures: a real-text corpus and a tokenizer made here (no network), and a launcher for
real multi-process DeepSpeed runs on the CPU."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common.hardware import cpu_has_native_bf16

REPO = Path(__file__).resolve().parent.parent
CPU_ACCELERATE_CONFIG = REPO / "accelerate_configs" / "zero3_cpu.yaml"
TINY_RECIPE = REPO / "recipes" / "configs" / "tiny_cpu.yaml"


def built_once(tmp_path_factory, name: str, build):
    """What `build(directory)` returns (JSON), built once per test session however many pytest-xdist workers ask:
    the first builds under a lock while the others wait, then all read the record it left. A build that failed
    half-way leaves no record, so the next one starts again from an empty directory."""
    from filelock import FileLock

    from common.files import atomic_write_text

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker has its own basetemp under the session's
        root = root.parent
    directory, record = root / name, root / f"{name}.json"
    with FileLock(f"{directory}.lock"):
        if not record.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            atomic_write_text(record, json.dumps(build(directory)))  # whole or absent, whoever is killed when
        return json.loads(record.read_text())


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Python standard-library sources as jsonl (1.5 MB train, 0.2 MB validation) and a 1024-token BPE."""

    def build(root: Path) -> dict[str, str]:
        from data_prep.reading import demo_corpus
        from data_prep.tokenizer.training import main as train_tokenizer

        demo_corpus.build(root / "data", train_bytes=1_500_000, validation_bytes=200_000)
        train_tokenizer(["--input", str(root / "data" / "train.jsonl"), "--vocab-size", "1024", "--output",
                         str(root / "tokenizer")])  # fmt: skip
        return {"train": str(root / "data" / "train.jsonl"), "validation": str(root / "data" / "validation.jsonl"),
                "tokenizer": str(root / "tokenizer")}  # fmt: skip

    return {key: Path(path) for key, path in built_once(tmp_path_factory, "corpus", build).items()}


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


# The tiny runs train in bf16, as a 70B run does, where the CPU computes bf16 natively, and in fp32 elsewhere;
# tests/test_pretrain_zero3.py keeps a short bf16 run on every machine.
TEST_BF16 = cpu_has_native_bf16()

# DeepSpeed JIT-builds its CPU ops with the first `ninja` on PATH, and ninja rebuilds whenever the build command's hash
# changes, which it does between ninja versions: with the venv's ninja first for some launches (the Slurm jobs, which
# need the venv's `accelerate`) and a system ninja for others, every switch cost ~40 s of rebuilding both ops. Every
# process the tests start finds the venv's tools first, as in an activated venv.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
LAUNCH_ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}


def start(command: list[str], **kwargs) -> subprocess.Popen:
    """A launch in a session of its own (as a scheduler starts one). torchrun gives every rank a session of its
    own too, so a signal to this process group does not reach the ranks: `kill_whole_tree` does."""
    env = kwargs.pop("env", LAUNCH_ENV)
    return subprocess.Popen(command, cwd=REPO, env=env, text=True, start_new_session=True, **kwargs)


def kill_whole_tree(root_pid: int) -> int:
    """SIGKILL a launcher, every rank and every dataloader worker at once, as a node crash does. Returns how many
    processes there were."""
    from common.process import kill_tree

    return kill_tree(root_pid)


def launch(script: str | Path, args: list[str], num_processes: int = 2, timeout_s: int = 600, env=None):
    """Run a launch to the end; returns the finished process (output captured). A hung run is killed whole."""
    command = launch_command(script, args, num_processes)
    process = start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env or LAUNCH_ENV)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_whole_tree(process.pid)
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
        "bf16": str(TEST_BF16).lower(),
        **extra,
    }
    args = ["--config", str(TINY_RECIPE)]
    for key, value in values.items():
        args += [f"--{key}", str(value)]
    return args


def data_position(checkpoint: Path) -> dict:
    """The data position a checkpoint saved (its one home: trainer_state.json)."""
    return json.loads((checkpoint / "trainer_state.json").read_text())["data_position"]


def forge_data_position(checkpoint: Path, change) -> None:
    """Rewrite a checkpoint's data position with `change(position)`, and its manifest entry with it, so that the
    checkpoint stays self-consistent: what a negative control needs to show that the position matters."""
    from common.files import sha256_of

    state_path = checkpoint / "trainer_state.json"
    state = json.loads(state_path.read_text())
    change(state["data_position"])
    state_path.write_text(json.dumps(state, indent=2))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["trainer_state.json"] = {"bytes": state_path.stat().st_size, "sha256": sha256_of(state_path)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2))


def train_losses(output_dir: Path) -> dict[int, float]:
    """{step: loss} of a run's metrics.jsonl."""
    from recipes.telemetry.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(Path(output_dir) / "metrics.jsonl") if "loss" in r}


def eval_losses(output_dir: Path) -> dict[int, float]:
    """{step: eval_loss} of a run's metrics.jsonl."""
    from recipes.telemetry.metrics import read_metrics

    return {r["step"]: r["eval_loss"] for r in read_metrics(Path(output_dir) / "metrics.jsonl") if "eval_loss" in r}


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, corpus) -> dict:
    """One tiny 2-process ZeRO-3 run for the whole session: 40 steps, checkpoints every 10 (the last two kept),
    validation at 20 and 40, and final/. Tests that only read a finished run (its metrics, checkpoints, export,
    report, or its model for evaluation) share it instead of training their own."""
    from recipes.config import load_config

    schedule = dict(max_steps=40, logging_steps=5, eval_steps=20, save_steps=10, save_total_limit=2, warmup_steps=5)

    def args(output_dir: Path) -> list[str]:
        return tiny_overrides(corpus, output_dir, **schedule, max_eval_samples=32, early_stopping_patience=5)

    def build(output_dir: Path) -> dict[str, str]:
        result = launch(REPO / "recipes/pretrain.py", args(output_dir))
        assert result.returncode == 0, result.stderr[-6000:]
        return {"dir": str(output_dir), "log": result.stderr + result.stdout}

    built = built_once(tmp_path_factory, "trained_run", build)
    output_dir = Path(built["dir"])
    return {"dir": output_dir, "log": built["log"], "config": load_config(TINY_RECIPE, args(output_dir)[2:]),
            "corpus": corpus, "steps": 40}  # fmt: skip


# The session's reference run: 16 steps, a checkpoint every 4 (the newest two kept: 12 and 16), every step logged,
# validation at 8 and 16. Tests that resume, kill or damage a run compare with it.
REFERENCE_RUN = dict(max_steps=16, save_steps=4, save_total_limit=2, logging_steps=1, eval_steps=8,
                     max_eval_samples=16, warmup_steps=4)  # fmt: skip


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, corpus) -> Path:
    """The output directory of one uninterrupted REFERENCE_RUN, shared by the whole session (copy it to change it)."""

    def build(output_dir: Path) -> str:
        result = launch(REPO / "recipes/pretrain.py", tiny_overrides(corpus, output_dir, **REFERENCE_RUN))
        assert result.returncode == 0, result.stderr[-4000:]
        assert sorted(train_losses(output_dir)) == list(range(1, REFERENCE_RUN["max_steps"] + 1))
        return str(output_dir)

    return Path(built_once(tmp_path_factory, "reference_run", build))


# The files that take longest (each ~3 minutes of a worker's time on 2 cores) go first, so that with pytest-xdist's
# two workers (`make test`) none of them is left to run alone at the end while the other worker has nothing to do.
LONGEST_FILES_FIRST = ("test_run_safety.py", "test_slurm.py", "test_resume.py", "test_preprocessed_training.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FILES_FIRST.index(name) if name in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)

    items.sort(key=rank)  # stable: the order inside each file, and of the other files, is kept


def old_tree(tmp_path_factory, commit: str) -> Path:
    """The project's files at an earlier commit of this repository (the compatibility tests run the old code)."""
    tree = tmp_path_factory.mktemp(commit)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {commit} is not in this clone's history (shallow clone?)")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree

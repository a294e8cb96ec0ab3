"""`python -m recipes.launch`: `accelerate launch` with the ranks' own exit code, a stop signal that lets them save, and
a bad input said in one line (bare, the launcher exits 1 after a 35-line traceback, and 143 on SIGTERM)."""

import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from recipes.launch import LauncherTracebackFilter, local_ranks_of, run_exit_code, torchrun_signals
from tests.conftest import CPU_ACCELERATE_CONFIG, LAUNCH_ENV, REFERENCE_RUN, REPO, free_port, start, tiny_overrides

PRETRAIN = REPO / "recipes/pretrain.py"
TORCHRUN_SUMMARY = (
    b'Traceback (most recent call last):\n  File "/venv/accelerate/commands/launch.py", line 9, in <module>\n'
    b"    main()\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    b"============================\nrecipes/pretrain.py FAILED\n----------------------------\n"
    b"Failures:\n  <NO_OTHER_FAILURES>\n  exitcode  : 2 (pid: 12)\n============================\n"
)


def wrapped(args: list[str], num_processes: int = 2) -> list[str]:
    return [sys.executable, "-m", "recipes.launch", "--config_file", str(CPU_ACCELERATE_CONFIG), "--num_processes",
            str(num_processes), "--main_process_port", str(free_port()), str(PRETRAIN), *args]  # fmt: skip


@pytest.mark.parametrize("chunk", [1, 5, 64, 100_000])
def test_only_torchruns_own_traceback_is_left_out(chunk):
    rank_traceback = b'Traceback (most recent call last):\n  File "recipes/x.py", line 3\n    f()\nValueError: boom\n'
    kept = b"error: learning_rate 'x'\n50%|##   | 1/2\rTrace100%|#####| 2/2\n" + rank_traceback
    text = kept + TORCHRUN_SUMMARY
    lines = LauncherTracebackFilter()
    out = b"".join(lines.feed(text[i : i + chunk]) for i in range(0, len(text), chunk)) + lines.close()
    assert out == kept and lines.dropped
    plain = LauncherTracebackFilter()
    assert plain.feed(rank_traceback) + plain.close() == rank_traceback and not plain.dropped


def test_a_rank_killed_by_a_signal_is_named_in_the_last_line():
    """The kernel's out-of-memory killer SIGKILLs a rank (host memory is a classic 70B failure with the optimizer
    offloaded): the only evidence was torchrun's table, which the wrapper leaves out, so the log said "none
    recorded". The table's killed ranks are kept for the last line."""
    from recipes.launch import killed_ranks, ranks_said

    block = (
        b'Traceback (most recent call last):\n  File "/venv/accelerate/commands/launch.py", line 9, in <module>\n'
        b"    main()\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        b"============================\nrecipes/pretrain.py FAILED\n----------------------------\n"
        b"Failures:\n[1]:\n  time      : 2026-12-06_08:00:00\n  host      : n2\n  rank      : 9 (local_rank: 1)\n"
        b"  exitcode  : -15 (pid: 14) SIGTERM\n  error_file: <N/A>\n"
        b"  traceback : Signal 15 (SIGTERM) received by PID 14\n"
        b"----------------------------\nRoot Cause (first observed failure):\n[0]:\n  time      : 2026-12-06_08:00:00\n"
        b"  host      : n2\n  rank      : 8 (local_rank: 0)\n  exitcode  : -9 (pid: 13) SIGKILL\n"
        b"  error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received by PID 13\n============================\n"
    )  # fmt: skip
    lines = LauncherTracebackFilter()
    assert lines.feed(b"step 10 loss 2.3\n" + block) + lines.close() == b"step 10 loss 2.3\n"
    killed = killed_ranks(b"".join(lines.swallowed))
    assert killed == {8: "SIGKILL", 9: "SIGTERM"}
    assert ranks_said({0: 1}, killed) == ("rank 0: 1, rank 8: killed by SIGKILL (out of memory? see dmesg), "
                                          "rank 9: killed by SIGTERM")  # fmt: skip
    assert ranks_said({}, {}) == "none recorded" and killed_ranks(TORCHRUN_SUMMARY) == {}


def test_the_runs_code_is_the_ranks(tmp_path):
    assert run_exit_code({0: 0, 1: 0}, 2, 1) == 0  # saved and stopped: torchrun may still say 1 or 143
    assert run_exit_code({1: 0}, 1, -15) == 0, "one node's rank saved; Slurm then SIGTERMed its launcher"
    assert run_exit_code({0: 2, 1: 2}, 2, 1) == 2
    assert run_exit_code({0: 0, 1: 4}, 2, 1) == 4
    assert run_exit_code({0: 0}, 2, 1) == 1, "a rank that recorded nothing (killed, crashed) is the launcher's code"
    assert run_exit_code({}, 2, -9) == 1 and run_exit_code({0: 0}, None, 0) == 0
    config = tmp_path / "accelerate.yaml"
    config.write_text("num_machines: 2\nnum_processes: 16\n")
    assert local_ranks_of(["--config_file", str(config), "x.py"]) == 8
    assert local_ranks_of(["--config_file", str(config), "--num_machines", "3", "--num_processes", "3"]) == 1
    assert local_ranks_of(["--num_processes=4", "x.py"]) == 4 and local_ranks_of(["x.py"]) is None


@pytest.mark.multiprocess
def test_a_bad_input_through_the_launcher_is_one_line_and_exit_2(tmp_path, corpus):
    args = tiny_overrides(corpus, tmp_path / "run", learning_rate="banana")
    result = subprocess.run(wrapped(args), cwd=REPO, capture_output=True, text=True, timeout=300, env=LAUNCH_ENV)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "learning_rate" in errors[0], result.stderr
    # torchrun stops the other rank once one has failed, sometimes before it has recorded its own code
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("launch: exit 2 (bad input); the ranks' codes: rank ") and re.search(r"rank \d+: 2\b", last)


def terminated_once_logged(tmp_path, corpus, output_dir, line: str, signals=(signal.SIGTERM,), code=0,
                           every_process=False) -> str:  # fmt: skip
    """The log of a wrapped run of the tiny recipe sent `signals` as soon as it logs `line` (to the wrapper, or to
    every process of the launch, as Slurm does); it must exit `code` (None: any code but 0)."""
    log_path = tmp_path / "log.txt"
    with open(log_path, "w") as log:
        job = start(wrapped(tiny_overrides(corpus, output_dir, **{**REFERENCE_RUN, "max_steps": 400})), stdout=log,
                    stderr=log)  # fmt: skip
        deadline = time.time() + 300
        while line not in log_path.read_text() and time.time() < deadline:
            assert job.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.02)
        for number in signals:
            for process in [psutil.Process(job.pid)] + (psutil.Process(job.pid).children(recursive=True)
                                                        if every_process else []):  # fmt: skip
                process.send_signal(number)
            time.sleep(0.5)
        returned = job.wait(timeout=180)
        assert returned == code if code is not None else returned != 0, log_path.read_text()[-3000:]
    return log_path.read_text()


@pytest.mark.multiprocess
def test_ctrl_c_to_the_launch_saves_and_exits_0_and_a_second_one_stops_unsaved(tmp_path, corpus):
    """A run started without Slurm and stopped with Ctrl-C (README), forwarded to the ranks as SIGTERM, which `kill
    PID` sends (its own test is the stop during the start below): the ranks save and the launch exits 0 (bare
    `accelerate launch` exits 143, and its torchrun SIGKILLs the ranks 30 s after the signal). A second Ctrl-C stops
    them unsaved (run-safety.md)."""
    output_dir = tmp_path / "run"
    log = terminated_once_logged(tmp_path, corpus, output_dir, "INFO pretrain: loss", signals=[signal.SIGINT])
    assert "launch: SIGINT: asked" in log and "(SIGTERM); a second Ctrl-C stops them unsaved" in log
    assert "stop signal (SIGTERM/SIGUSR1): saved and exited" in log
    assert (output_dir / "latest").read_text().startswith("checkpoint-") and (output_dir / "run_summary.json").exists()
    # twice while the model is built (seconds: the first would stop the run at its first step boundary)
    (tmp_path / "twice").mkdir()
    log = terminated_once_logged(tmp_path / "twice", corpus, tmp_path / "twice" / "run", "INFO pretrain: preflight",
                                 signals=[signal.SIGINT, signal.SIGINT], code=None)  # fmt: skip
    assert "launch: SIGINT: asked" in log and "training stopped" not in log, log[-3000:]


@pytest.mark.multiprocess
def test_a_sigterm_to_every_process_of_the_launch_lets_the_ranks_save(tmp_path, corpus):
    """Slurm's preemption and `scancel` signal every process of a job step: the wrapper, torchrun, the ranks, their
    dataloader workers. torchrun acted on its copy: it signalled the ranks and SIGKILLed them 30 s later, mid-save at
    70B (~233 s). It leaves SIGTERM to the ranks now, which save, and the launch exits 0."""
    output_dir = tmp_path / "run"
    log = terminated_once_logged(tmp_path, corpus, output_dir, "INFO pretrain: loss", every_process=True)
    assert "stop signal (SIGTERM/SIGUSR1): saved and exited" in log and "death signal" not in log, log[-3000:]
    assert (output_dir / "latest").read_text().startswith("checkpoint-")


def test_torchrun_is_never_given_sigterm_to_act_on():
    assert torchrun_signals({}) == "SIGINT,SIGHUP,SIGQUIT"
    assert torchrun_signals({"PET_SIGNALS_TO_HANDLE": "SIGUSR2, SIGTERM"}) == "SIGUSR2"
    assert torchrun_signals({"PET_SIGNALS_TO_HANDLE": "SIGTERM"}) == "SIGINT"


@pytest.mark.multiprocess
def test_a_stop_signal_during_the_start_ends_the_run_cleanly_with_nothing_to_save(tmp_path, corpus):
    """At 70B a start takes minutes to half an hour (checksums, an elastic conversion, the model); a stop signal in that
    time killed the ranks (exit 1, a crash to a scheduler). It now waits for the first step boundary: the run stops
    there, having trained nothing, saves nothing, and exits 0."""
    output_dir = tmp_path / "run"
    log = terminated_once_logged(tmp_path, corpus, output_dir, "INFO pretrain: preflight")  # before the model is built
    assert "launch: SIGTERM: asked" in log and "training stopped after 0 steps" in log, log[-3000:]
    assert not re.search(r"INFO pretrain: loss \d", log) and not list(output_dir.glob("checkpoint-*"))

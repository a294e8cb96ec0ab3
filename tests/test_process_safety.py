"""Process hygiene without a training run: one writer per directory, and children that die with their parent."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.lock import DirectoryLock, LockedError
from tests.conftest import REPO

HOLD = """
import sys, time
from common.lock import DirectoryLock
DirectoryLock(sys.argv[1], "test run").acquire()
print("held", flush=True)
time.sleep(600)
"""


def hold_lock(directory):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_live_holder_keeps_the_directory_and_is_named(tmp_path):
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(LockedError) as error:
            DirectoryLock(tmp_path, "training run").acquire()
        assert f"pid {holder.pid}" in str(error.value) and "started" in str(error.value)
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_holder_on_this_host_is_taken_over(tmp_path):
    holder = hold_lock(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == holder.pid, "SIGKILL leaves the record"
    lock = DirectoryLock(tmp_path, "training run").acquire()
    assert lock.took_over["pid"] == holder.pid
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / ".lock").exists()
    DirectoryLock(tmp_path, "training run").acquire().release()  # free again


def test_a_lock_recorded_by_another_host_is_never_taken_over(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"host": "node-17", "pid": 4242, "started": "yesterday"}))
    with pytest.raises(LockedError) as error:
        DirectoryLock(tmp_path, "training run").acquire()
    assert "another host (host node-17, pid 4242" in str(error.value) and "delete" in str(error.value)


def test_a_requeued_slurm_job_takes_over_the_lock_its_earlier_start_left_on_another_host(tmp_path, monkeypatch):
    """The head node died (its lock stays behind) and Slurm requeued the job onto other nodes: the same job with a
    higher restart count takes the lock over; another job, or the same start, still does not."""
    record = {"host": "node-17", "pid": 4242, "started": "yesterday", "slurm_job_id": "77", "slurm_restart_count": 0}
    (tmp_path / ".lock").write_text(json.dumps(record))
    refused = [("78", "1"), ("77", "0"), ("77", None)]  # another job; this same start; no restart count
    for job, restarts in refused:
        monkeypatch.setenv("SLURM_JOB_ID", job)
        if restarts is None:
            monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
        else:
            monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
        with pytest.raises(LockedError, match="another host"):
            DirectoryLock(tmp_path, "training run").acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = DirectoryLock(tmp_path, "training run").acquire()
    assert lock.took_over["host"] == "node-17"
    mine = json.loads((tmp_path / ".lock").read_text())
    assert mine["pid"] == os.getpid() and (mine["slurm_job_id"], mine["slurm_restart_count"]) == ("77", 1)
    lock.release()
    # a lock written outside Slurm (no job id) is never taken over from another host
    (tmp_path / ".lock").write_text(json.dumps({"host": "node-17", "pid": 4242, "started": "yesterday"}))
    with pytest.raises(LockedError, match="another host"):
        DirectoryLock(tmp_path, "training run").acquire()


def test_a_start_that_lives_on_after_its_requeue_leaves_the_new_starts_lock_alone(tmp_path):
    """A head node cut off from the cluster: Slurm requeued the job elsewhere and its next start took the lock over
    (rewriting the same file); when the old start finally exited, its release deleted the new start's lock, and a
    second launch into the live run's directory would then have been let in. A release removes only its own record."""
    old_start = DirectoryLock(tmp_path, "training run").acquire()
    takeover = {"host": "node-18", "pid": 99, "started": "now", "slurm_job_id": "77", "slurm_restart_count": 1}
    (tmp_path / ".lock").write_text(json.dumps(takeover))  # what the next start wrote
    old_start.release()
    assert json.loads((tmp_path / ".lock").read_text()) == takeover
    # or a person deleted it (as a lock left on another host asks) and a new run wrote its own: a new file
    old_start = DirectoryLock(tmp_path / "again", "training run").acquire()
    (tmp_path / "again" / ".lock").unlink()
    (tmp_path / "again" / ".lock").write_text(json.dumps(takeover))
    old_start.release()
    assert json.loads((tmp_path / "again" / ".lock").read_text()) == takeover


CHILD = """
import os, sys, time
from common.process import die_with_parent
die_with_parent()
print(os.getpid(), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_child_dies_with_its_parent(tmp_path):
    # parent: a shell that starts the child in a session of its own (as torchrun does), then is killed
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {CHILD!r}], "
         "start_new_session=True).wait()"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and _alive(child_pid):
        time.sleep(0.05)
    assert not _alive(child_pid), "the child outlived its parent"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_second_preprocessing_into_a_busy_output_stops_naming_the_holder(tmp_path, corpus, capsys):
    from data_prep.preprocessing.cli import main as preprocess_main

    output = tmp_path / "packed"
    holder = hold_lock(output)
    try:
        code = preprocess_main(["--tokenizer", str(corpus["tokenizer"]), "--input", str(corpus["train"]), "--output",
                                str(output), "--num-workers", "1"])  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    assert code == 2
    error = capsys.readouterr().err
    assert "is in use by another preprocessing (host" in error and f"pid {holder.pid}" in error
    assert not (output / "data").exists(), "nothing was written"


def test_a_command_reports_its_own_peak_memory_not_its_launchers(tmp_path):
    """ru_maxrss survives exec: preprocessing started from a 1.1 GB test runner once recorded 1,147 MB as its own
    main-process peak (the runner's), against 485 MB measured from outside."""
    launcher = (
        "import subprocess, sys\n"
        "held = bytearray(600 * 2**20)\n"
        "held[::4096] = b'x' * len(held[::4096])  # touched, so resident\n"
        "print(subprocess.run([sys.executable, '-c', 'from common.process import peak_rss_bytes; "
        "print(peak_rss_bytes() / 2**20)'], capture_output=True, text=True, check=True).stdout)\n"
    )
    result = subprocess.run([sys.executable, "-c", launcher], cwd=REPO, capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    child_peak_mb = float(result.stdout)
    assert 1 < child_peak_mb < 300, f"the child reported {child_peak_mb:.0f} MB, its launcher held 600 MB"


def test_deepspeed_op_builds_and_loads_wait_for_each_other_on_a_host(tmp_path, caplog, monkeypatch):
    """Two ranks that found an op missing at once raced in torch's extension cache: one stopped with a traceback
    while the other built for minutes. Every load now takes a host-wide lock and waits, saying for whom."""
    import threading

    from deepspeed.ops.op_builder.builder import OpBuilder

    from recipes.training.op_builds import one_at_a_time, serialize_op_builds

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))  # not this host's real cache
    serialize_op_builds()
    serialize_op_builds()
    assert OpBuilder.jit_load.one_at_a_time and OpBuilder.jit_load.__wrapped__.__name__ == "jit_load"
    assert not hasattr(OpBuilder.jit_load.__wrapped__, "one_at_a_time"), "wrapped once"

    path, loads = tmp_path / "build.lock", []
    load = one_at_a_time(lambda builder: loads.append(builder.name) or "module", path=lambda: path)
    builder = type("Builder", (), {"name": "cpu_adam"})()
    holder = hold_lock_file(path)  # another process building
    try:
        with caplog.at_level("INFO", logger="pretrain"):
            waiting = threading.Thread(target=load, args=(builder,))
            waiting.start()
            time.sleep(1.0)
            assert waiting.is_alive() and loads == [], "it waits for the build"
    finally:
        holder.kill()
        holder.wait()
    waiting.join(timeout=10)
    assert loads == ["cpu_adam"] and not path.exists(), "loaded once the build was done; no lock file left"
    assert "DeepSpeed op cpu_adam: waiting (0 s so far):" in caplog.text and f"pid {holder.pid}" in caplog.text


def hold_lock_file(path):
    code = (f"import sys, time; from common.lock import FileLock; FileLock({str(path)!r}, what='a build').acquire(); "
            "print('held', flush=True); time.sleep(600)")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


class _DeletedByFinalization:
    """Left in a module's global by a rank: the interpreter's finalization deletes it, which writes `path`; an exit
    that skips finalization (common.process.exit_process) leaves no file."""

    def __init__(self, path: str):
        self.path, self.open = path, open  # by then the module's globals, its builtins included, may be gone

    def __del__(self):
        self.open(self.path, "w").close()


_LEFT_FOR_FINALIZATION = []


def test_torchs_build_lock_left_by_a_killed_load_is_removed_and_a_live_builds_is_kept(tmp_path, monkeypatch):
    """torch creates `<cache>/<op>/lock` at every load of a JIT op, built or not; a rank killed meanwhile (a timed-out
    launch here, a lost node or an out-of-memory kill in a run) left it, and every later start on the host waited
    for it forever at its op load. Under the host-wide lock it is removed, unless a process works in that directory."""
    from torch.utils.cpp_extension import _get_build_directory

    from recipes.training.op_builds import one_at_a_time, remove_stale_baton

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    directory = Path(_get_build_directory("fake_op", verbose=False))
    baton = directory / "lock"
    baton.touch()
    loads = []
    load = one_at_a_time(lambda builder: loads.append(baton.exists()) or "module", path=lambda: tmp_path / "host.lock")
    assert load(type("Builder", (), {"name": "fake_op"})()) == "module" and loads == [False], "the stale lock is gone"
    baton.touch()
    ninja = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=directory)  # a live build
    try:
        time.sleep(0.5)
        assert not remove_stale_baton("fake_op") and baton.exists(), "a build in progress keeps its lock"
    finally:
        ninja.kill()
        ninja.wait()


def _gather_after_importing_transformers(rank, workdir, code=None):
    """What a rank's last moments do: a collective on Python-made tensors, with a long finalization ahead."""
    import torch.distributed as dist
    from transformers import LlamaConfig  # noqa: F401 (many modules: a finalization long enough to meet the thread)

    _LEFT_FOR_FINALIZATION.append(_DeletedByFinalization(f"{workdir}/finalized-rank-{rank}"))
    every = [None, None]
    dist.all_gather_object(every, {"rank": rank})
    return code


@pytest.mark.multiprocess
def test_ranks_exit_with_their_code_not_an_abort_at_finalization(tmp_path):
    """A gloo worker thread releases a collective's tensors after the collective has returned; the release takes the
    GIL, and one asked for while the interpreter finalized aborted the rank (SIGABRT, "terminate called without an
    active exception": rank 0 of the host-tax benchmark once, 6 of 15 two-rank runs of this kind here). Ranks now end
    through common.process.run_as_rank (as recipes/pretrain.py's and the benchmarks' do), which skips finalization:
    three runs, every rank exits 0 without finalizing (a marker each rank leaves to its finalization: one run tells),
    and a fourth whose ranks return 3 exits 3, not 0 nor an abort."""
    from gloo_ranks import on_ranks
    from torch.multiprocessing import ProcessExitedException

    # the abort is a race, met in some runs only; what prevents it is checked on every run: no rank finalized
    for attempt in range(3):
        on_ranks(_gather_after_importing_transformers, 2, tmp_path / str(attempt), str(tmp_path), timeout_s=30)
        assert list(tmp_path.glob("finalized-rank-*")) == [], f"run {attempt}: a rank went through finalization"
    with pytest.raises(ProcessExitedException) as exited:
        on_ranks(_gather_after_importing_transformers, 2, tmp_path / "exit-3", str(tmp_path), 3, timeout_s=30)
    assert exited.value.exit_code == 3 and list(tmp_path.glob("finalized-rank-*")) == [], str(exited.value)


def test_exit_process_runs_the_exit_handlers_and_flushes_before_it_exits(tmp_path):
    script = (
        "import atexit, sys\nfrom common.process import exit_process\n"
        "atexit.register(lambda: print('handler ran'))\nsys.stdout.write('buffered, ')\nexit_process(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 3 and result.stdout == "buffered, handler ran\n"


def test_sigusr2_writes_every_threads_stack_and_the_process_goes_on(tmp_path):
    """What docs/troubleshooting.md tells a person to send a run that seems stuck."""
    script = (
        "import sys, threading, time\nfrom common.process import stacks_on_request\nstacks_on_request()\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGUSR2)
        time.sleep(1)
        assert process.poll() is None, "still running"
    finally:
        process.kill()
    stderr = process.communicate()[1]
    assert "Current thread 0x" in stderr and stderr.count("hread 0x") == 2, "both threads"
    assert 'File "<string>", line' in stderr, "where the main thread waits"

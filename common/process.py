"""Process hygiene for long runs: children that cannot outlive their parent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Have the kernel send `sig` to this process when its parent dies (Linux; returns False elsewhere).

    torchrun starts every rank in a session of its own, so a launcher killed by SIGKILL (or a node agent that
    loses it) would leave the ranks training on as orphans beside the relaunch. SIGKILL, not SIGTERM: an
    orphaned rank must not try to save, since its peers may be gone; the last published checkpoint is intact.
    Call it from the child, early: the kernel ties the signal to the thread that forked it. `parent`: the pid the
    parent had, for a child that calls this only after an exec and an interpreter's start (its parent may be gone by
    then, and init's pid would be taken for it)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = parent or os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent died between getppid and prctl
        os.kill(os.getpid(), sig)
    return True


def kill_tree(root_pid: int) -> int:
    """SIGKILL a process, its children and theirs at once (a launcher, every rank, every dataloader worker: torchrun
    puts each rank in a session of its own, so a process-group kill misses them). Returns how many there were."""
    import contextlib

    import psutil

    try:
        root = psutil.Process(root_pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(tree, timeout=30)
    return len(tree)


def with_repo_on_path(environ, repo=None) -> dict[str, str]:
    """`environ` with the repository first on PYTHONPATH (what was there stays after it), for child processes that
    run `-m recipes...` or `recipes/pretrain.py` from any working directory."""
    from pathlib import Path

    root = str(repo or Path(__file__).resolve().parent.parent)
    rest = environ.get("PYTHONPATH")
    return {**environ, "PYTHONPATH": root + (os.pathsep + rest if rest else "")}


def local_world_size() -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE; outside a launch, the world size (one node), else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process's own program so far.

    On Linux this is VmHWM, the high-water mark of the current address space: ru_maxrss survives exec, so a
    command started from a 1 GB parent (a test runner, a notebook) would report the parent's 1 GB as its own.
    Elsewhere ru_maxrss (bytes on macOS, KiB otherwise)."""
    import resource

    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def exit_process(code: int) -> NoReturn:
    """Exit a rank with `code` once the atexit handlers have run and the standard streams are flushed, skipping the
    interpreter's finalization. A gloo worker thread releases a collective's tensors after the collective has
    returned, and their release takes the GIL: asked for while the interpreter finalizes, the thread is ended inside a
    C++ destructor, std::terminate aborts the process ("terminate called without an active exception", SIGABRT, exit
    134), and a run that succeeded is reported failed (6 of 15 two-rank runs here, once their imports made finalizing
    long enough)."""
    import atexit

    atexit._run_exitfuncs()  # noqa: SLF001 (what finalization would run first: lock release, logging's flush)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_as_rank(main: Callable[[], int | None]) -> NoReturn:
    """`main()` as a rank's whole life: its code (None: 0), or 1 with the traceback printed for an exception, given
    to `exit_process`."""
    try:
        code = main() or 0
    except Exception:  # a bug: the traceback, and 1 (which a scheduler requeues; the abort above gave 134)
        import traceback

        traceback.print_exc()
        code = 1
    exit_process(code)


def stacks_on_request(sig: int = signal.SIGUSR2) -> None:
    """`sig` writes every thread's Python stack to stderr and the process goes on: what a person asks of a run that
    seems stuck before the hang watchdog would end it (Slurm, torchrun and the launch wrapper send SIGUSR2 to no one;
    the forked dataloader workers inherit it)."""
    import faulthandler

    faulthandler.register(sig, all_threads=True, chain=False)

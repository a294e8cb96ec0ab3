"""DeepSpeed's C++ ops (CPU Adam, the CPU accelerator's shared-memory collectives) are built just in time, the first
time a process loads them, into torch's extension cache, one directory per host and user shared by every process.
Two processes that find an op missing at once used to race in it: one rank stopped with a traceback while another
built for minutes, before the hang watchdog was armed. Every load of the recipe's processes takes a host-wide lock
in that cache first, so one process builds and the others wait, saying for whom, then load what it built."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

from common.lock import FileLock, LockedError

logger = logging.getLogger("pretrain")
LOCK_NAME = ".pretrain-op-build.lock"
POLL_S = 0.2
SAY_EVERY_S = 30.0


def lock_path() -> Path:
    from torch.utils.cpp_extension import get_default_build_root  # TORCH_EXTENSIONS_DIR, else ~/.cache/...

    root = Path(get_default_build_root())
    root.mkdir(parents=True, exist_ok=True)
    return root / LOCK_NAME


def one_at_a_time(load: Callable, path: Callable[[], Path] = lock_path) -> Callable:
    """`load(builder, ...)` (an op builder's `jit_load`) under the host-wide lock, waiting for it as long as it
    takes (a build takes minutes) and saying every `SAY_EVERY_S` whom it waits for."""

    @functools.wraps(load)
    def locked(builder, *args, **kwargs):
        lock, said = FileLock(path(), what="a process building or loading DeepSpeed's ops"), 0.0
        started = time.monotonic()
        while True:
            try:
                lock.acquire()
                break
            except LockedError as error:
                waited = time.monotonic() - started
                if waited >= said:
                    logger.info("DeepSpeed op %s: waiting (%.0f s so far): %s", builder.name, waited, error)
                    said = waited + SAY_EVERY_S
                time.sleep(POLL_S)
        try:
            remove_stale_baton(builder.name)
            return load(builder, *args, **kwargs)
        finally:
            lock.release()

    locked.one_at_a_time = True
    return locked


def remove_stale_baton(name: str) -> bool:
    """Remove torch's own build lock of op `name` (`<cache>/<tag>/<name>/lock`, a FileBaton every load creates, even
    of a built op, and removes when done) when no process works in that directory: one left there is a process's
    killed while it loaded (a timed-out launch, a lost node, an out-of-memory kill at start), and torch waits for it
    forever: every later start on the host hung at its op load, before the hang watchdog. Called under the host-wide
    lock, so no process of ours is loading. Returns whether it removed one."""
    from torch.utils.cpp_extension import _get_build_directory

    directory = Path(_get_build_directory(name, verbose=False))
    baton = directory / "lock"
    if not baton.exists() or working_in(directory):
        return False
    logger.warning("DeepSpeed op %s: removing %s, torch's build lock left by a process killed while it loaded the "
                   "op (torch would wait for it forever)", name, baton)  # fmt: skip
    baton.unlink(missing_ok=True)
    return True


def working_in(directory: Path) -> bool:
    """Whether a live process has `directory` as its working directory (ninja and the compiler a build runs)."""
    import psutil

    return any(process.info.get("cwd") == str(directory) for process in psutil.process_iter(["cwd"]))


def serialize_op_builds() -> None:
    """From now on every DeepSpeed JIT op load in this process takes the lock (idempotent)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    if not getattr(OpBuilder.jit_load, "one_at_a_time", False):
        OpBuilder.jit_load = one_at_a_time(OpBuilder.jit_load)

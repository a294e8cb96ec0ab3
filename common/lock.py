"""One writer per directory: a lock file that names its holder.

`DirectoryLock(path).acquire()` creates `path/.lock`, holds an exclusive `flock` on it for the life of the
process, and writes who holds it (host, pid, process start time, command). A second process finds the flock
taken and stops, naming the holder. The kernel drops the flock when its holder dies, even by SIGKILL, so a lock
left by a dead process on this host is taken over (with a warning). A lock recorded by another host is never
taken over: on a shared filesystem without working cross-node flock a live holder there would look dead, so
the error says how to clear it by hand once that node is known to be down. The one exception is Slurm's own
requeue: a lock recorded by an earlier start of this same job (its SLURM_JOB_ID, a lower SLURM_RESTART_COUNT) is
taken over wherever it was held, because Slurm starts a job again only once its previous start has ended, and a
requeue after a lost head node lands on another host.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = ".lock"


class LockedError(RuntimeError):
    """Another process holds the directory; the message names it and what to do."""


def _this_process() -> dict:
    import psutil

    me = psutil.Process()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_started": me.create_time(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(sys.argv)[:500],
    } | _slurm_start()


def _slurm_start() -> dict:
    """Which start of which Slurm job this process belongs to (empty outside Slurm)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return {}
    return {"slurm_job_id": job, "slurm_restart_count": _restart_count(os.environ.get("SLURM_RESTART_COUNT"))}


def _restart_count(value) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def earlier_start_of_this_job(holder: dict) -> bool:
    """Whether `holder` was an earlier start of the Slurm job this process runs in (so it has ended)."""
    mine = _slurm_start()
    return (
        bool(mine)
        and str(holder.get("slurm_job_id")) == mine["slurm_job_id"]
        and "slurm_restart_count" in holder
        and _restart_count(holder["slurm_restart_count"]) < mine["slurm_restart_count"]
    )


def _alive_on_this_host(holder: dict) -> bool:
    import psutil

    try:
        process = psutil.Process(int(holder.get("pid", -1)))
        # a reused pid belongs to a process started later than the holder
        return abs(process.create_time() - float(holder.get("process_started", 0))) < 1.0
    except (psutil.NoSuchProcess, ValueError):
        return False


def describe(holder: dict) -> str:
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started', '?')}"


class DirectoryLock:
    def __init__(self, directory: str | Path, what: str):
        self.directory, self.what = Path(directory), what
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None
        self._written: dict = {}  # what acquire wrote into the lock file
        self.took_over: dict | None = None  # the dead holder replaced, if any

    def acquire(self) -> DirectoryLock:
        """Take the lock or raise LockedError; creates the directory."""
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise LockedError(
                    f"{self.directory} is in use by another {self.what} ({describe(holder)}); wait for it to end, "
                    "stop it, or choose another directory"
                ) from None
            # the file may have been removed by its holder's release between our open and our flock
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        previous = _read(fd)
        if previous and previous.get("host") != socket.gethostname() and not earlier_start_of_this_job(previous):
            os.close(fd)
            raise LockedError(
                f"{self.directory} is locked by a {self.what} on another host ({describe(previous)}). If that run "
                f"is over (its node died), delete {self.path} and launch again"
            )
        if previous and previous.get("host") == socket.gethostname() and _alive_on_this_host(previous):
            os.close(fd)
            raise LockedError(f"{self.directory} is in use by another {self.what} ({describe(previous)})")
        self.took_over = previous or None
        self._written = _this_process()
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self._written).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        # A later start that took the lock over (this job requeued onto other nodes while this process lived on,
        # cut off from the cluster) rewrote it: the file is that start's now, and stays
        with contextlib.suppress(FileNotFoundError):
            # (or a person deleted it, as a lock from another host's dead run asks, and a new run wrote its own)
            # read afresh, by path: through a descriptor held for days an NFS client may serve its old pages
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino and _read_path(self.path) == self._written:
                os.unlink(self.path)  # before the flock goes, so no one takes over a lock file about to vanish
        os.close(self._fd)
        self._fd = None


def _read_path(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 1 << 16, 0).decode() or "{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


class FileLock:
    """A flock on one file for as long as it is held: shared for readers (any number at once), exclusive for one
    writer. Non-blocking: `acquire` raises LockedError naming the file when the lock is taken. The kernel drops it
    when the holder dies. (flock is reliable between processes of one host; on a shared filesystem across hosts only
    where the filesystem supports it.)"""

    def __init__(self, path: str | Path, shared: bool = False, what: str = "another process"):
        self.path, self.shared, self.what = Path(path), shared, what
        self._fd: int | None = None

    def acquire(self) -> FileLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise LockedError(f"{self.path} is held by {self.what} ({describe(holder)})") from None
            # the last holder removes the file as it lets go (`release`): a lock on a removed file is no lock
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        if not self.shared:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_this_process()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Let go; the last holder removes the lock file, so finished work leaves none behind. (A shared holder is the
        last when it can take the lock exclusively; a process that opened the file meanwhile finds it removed and
        makes a new one.)"""
        if self._fd is None:
            return
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # other readers hold it: the last of them removes it
        else:
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                    os.unlink(self.path)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *_) -> None:
        self.release()


def held_by_someone(path: str | Path) -> bool:
    """Whether any process holds a flock (shared or exclusive) on `path` now; False when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False

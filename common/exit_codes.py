"""The exit codes of every command, one meaning each, so that a scheduler can act on any of them alike
(docs/run-safety.md, "Exit codes of every command"), and the one-line messages that go with them."""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import sys
from pathlib import Path

DONE = 0
RETRY = 1  # transient: a worker process was killed or crashed; the same command again continues (requeue it)
BAD_INPUT = 2  # a flag, file or key a person must fix: the same command fails the same way until then
DISK_FULL = 4  # the output's filesystem is full or over quota: make room, then the same command continues
# 3 (a non-finite loss) and 5 (a data stall) are the training ranks' own: docs/run-safety.md

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, over quota, over the file-size limit (RLIMIT_FSIZE)
_RUST_OS_ERROR = re.compile(r"os error (\d+)")  # how tokenizers and safetensors (Rust) report an I/O error


def os_error_in(error: BaseException | None) -> OSError | None:
    """The OSError that caused `error` (itself, or one along its chain of causes and contexts), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno is not None:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def disk_full(error: BaseException | None) -> OSError | None:
    """The full-disk error (ENOSPC, EDQUOT, EFBIG) behind `error`, if that is what it is: an OSError along its chain,
    or a Rust library's `... (os error 28)` message (tokenizers' and safetensors' writers raise no OSError)."""
    found = os_error_in(error)
    if found is not None:
        return found if found.errno in FULL else None
    seen = set()
    while error is not None and id(error) not in seen:
        match = _RUST_OS_ERROR.search(str(error))
        if match and int(match.group(1)) in FULL:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def free_space(path: str | Path) -> str:
    """`N.N GB free` on the filesystem that holds `path` (its nearest existing parent), or that it is unknown."""
    path = Path(path).absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    try:
        return f"{shutil.disk_usage(existing).free / 1e9:.1f} GB free"
    except (OSError, TypeError):
        return "free space unknown"


def disk_full_line(output: str | Path, error: OSError, then: str, flag: str = "--output", what: str = "a file") -> str:
    """The one line of a DISK_FULL exit: the output, what failed and where (`what` when the error does not say), the
    free space where it failed, and what the same command does once there is room."""
    where = error.filename or what
    free = free_space(error.filename or output)
    return (f"{flag} {output}: {error.strerror} while writing {where} ({free}). Make room (or raise the quota or "
            f"file-size limit) and run the same command again: {then}")  # fmt: skip


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, but a mistake on the command line is one line, `error: ...`, and BAD_INPUT (argparse
    prints its whole usage first: 2 to 15 lines, most of them the flags, not the mistake)."""

    def error(self, message: str):
        self.exit(BAD_INPUT, f"error: {message}\n")


def fail(message: str, code: int) -> int:
    """Print the one `error:` line of a failed command and return its exit code."""
    print(f"error: {message}", file=sys.stderr)
    return code

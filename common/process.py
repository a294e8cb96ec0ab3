"""Process hygiene for long runs: children that cannot outlive their parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent dies (Linux; returns False elsewhere).

    torchrun starts every rank in a session of its own, so a launcher killed by SIGKILL (or a node agent that
    loses it) would leave the ranks training on as orphans beside the relaunch. SIGKILL, not SIGTERM: an
    orphaned rank must not try to save, since its peers may be gone; the last published checkpoint is intact.
    Call it from the child, early: the kernel ties the signal to the thread that forked it."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent died between getppid and prctl
        os.kill(os.getpid(), sig)
    return True

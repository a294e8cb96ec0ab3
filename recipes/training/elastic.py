"""A run that continues on another number of processes (a node lost, or back) without a person: the checkpoint of
the old world size is converted to DeepSpeed's universal format at start, once, and the global batch is kept by
changing gradient accumulation (`elastic: true`; recipes.config.elastic_accumulation).

The conversion runs on global rank 0 in a child process (`deepspeed.checkpoint.ds_to_universal`, the tool DeepSpeed
ships) into `checkpoint-N/.universal.tmp-PID/`, renamed to `universal/` when complete: a crash half-way leaves only the
staging directory, which nothing trusts and the next start removes. The other ranks wait by watching the file system,
not in a collective: converting a 70B checkpoint (~830 GB of optimizer state) takes far longer than a process group's
timeout."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from common.collectives import main_process_view
from common.files import atomic_write_text, sync_directory, sync_tree, unused_name
from recipes.training import checkpointing, universal
from recipes.training.checkpointing import CheckpointError

logger = logging.getLogger("pretrain")

STAGING = ".universal.tmp"  # + "-PID" of the rank converting: a killed rank's converter can outlive it a moment
DAMAGED = "universal.damaged"  # a universal/ that could not be loaded, kept aside
FAILED = ".universal.failed"  # rank 0's error, for the ranks that wait (they cannot see its exception)
POLL_S = 1.0
# The converter sets its own parent-death signal after exec (a preexec_fn would run between fork and exec of a
# process with NCCL and torch threads, where taking a lock can deadlock): it ends with rank 0
DIES_WITH_PARENT = (
    "import runpy, sys; from common.process import die_with_parent; die_with_parent(parent=int(sys.argv[1])); "
    "sys.argv = sys.argv[2:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)
REPO_ROOT = str(Path(__file__).resolve().parents[2])  # where `common` is imported from


def convert(checkpoint: Path, workers: int | None = None, attempt: str = "") -> float:
    """`checkpoint`'s universal form, written atomically (rank 0). Returns the seconds it took. A failure is also
    written to FAILED for the ranks that wait, tagged with `attempt` (this start's: see `wait_for_conversion`)."""
    started = time.perf_counter()
    staging = checkpoint / f"{STAGING}-{os.getpid()}"
    if not any((checkpoint / "pytorch_model").glob("*optim_states.pt")):
        message = (f"elastic: {checkpoint} has no ZeRO rank shards left to convert and no loadable universal/ "
                   f"({'; '.join(universal.universal_problems(checkpoint)[:1]) or 'none'}): resume from an earlier "
                   "checkpoint (pass --resume_from_checkpoint) or restore its files")  # fmt: skip
        fail(checkpoint, attempt, message)
    workers = workers or max(1, min(8, (os.cpu_count() or 2) // 2))
    command = [sys.executable, "-c", DIES_WITH_PARENT, str(os.getpid()), "deepspeed.checkpoint.ds_to_universal",
               "--input_folder",
               str(checkpoint / "pytorch_model"), "--output_folder", str(staging / "pytorch_model"),
               "--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]  # fmt: skip
    logger.info("elastic: converting %s to DeepSpeed's universal format (%d workers)", checkpoint.name, workers)
    # ends with rank 0 (a kill of the launch): an orphan writing on would race the next start's conversion; its own
    # workers, should they outlive it, write into a staging directory no later start uses (each has its own)
    path = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    if result.returncode != 0 or not (staging / "pytorch_model" / "zero").is_dir():
        shutil.rmtree(staging, ignore_errors=True)
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        message = (f"elastic: converting {checkpoint} to the universal format failed (exit {result.returncode}): "
                   f"{tail[0]}")  # fmt: skip
        # killed (the out-of-memory killer, a stop): worth another start, so no bad input (exit 2, never requeued)
        fail(checkpoint, attempt, message, RuntimeError if result.returncode < 0 else CheckpointError)
    # each file synced to storage as it is hashed; `attempt` tells the waiting ranks this start's listing from a
    # lagging node's view of an earlier one
    listing = {"files": universal.universal_listing(staging), "attempt": attempt}
    sync_tree(staging)
    atomic_write_text(staging / universal.UNIVERSAL_LISTING, json.dumps(listing, indent=1))  # last: marks complete
    set_aside_damaged(checkpoint)
    os.replace(staging, checkpoint / checkpointing.UNIVERSAL_DIR)
    sync_directory(checkpoint)
    seconds = time.perf_counter() - started
    logger.info("elastic: %s converted in %.1f s", checkpoint.name, seconds)
    return seconds


def set_aside_damaged(checkpoint: Path, problems: list[str] | None = None) -> None:
    """A `universal/` that cannot be loaded (a conversion by hand cut short, a file lost or changed since) is renamed
    to `universal.damaged/` (or `universal.damaged-2/`, ... beside older ones), never deleted: it may be someone's only
    copy of what it holds.
    `problems`: what is wrong with it, when known (else its files are checked against its listing)."""
    converted = checkpoint / checkpointing.UNIVERSAL_DIR
    if not converted.exists():
        return
    problems = problems or universal.universal_problems(checkpoint)
    aside = unused_name(checkpoint / DAMAGED)
    os.replace(converted, aside)
    logger.warning("elastic: %s cannot be loaded (%s%s): set aside as %s, converting again", converted,
                   problems[0] if problems else "incomplete", f", and {len(problems) - 1} more" if problems[1:] else "",
                   aside.name)  # fmt: skip


def fail(checkpoint: Path, attempt: str, message: str, error: type[Exception] = CheckpointError):
    """Say `message` to the waiting ranks (they cannot see rank 0's exception), then raise it here."""
    atomic_write_text(checkpoint / FAILED, json.dumps({"attempt": attempt, "message": message}))
    raise error(message)


def converted_by(checkpoint: Path, attempt: str | None) -> bool:
    """Whether `checkpoint`'s universal/ is the one `attempt` wrote (any, for None)."""
    if attempt is None:
        return True
    try:
        listing = json.loads((checkpoint / checkpointing.UNIVERSAL_DIR / universal.UNIVERSAL_LISTING).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(listing, dict) and listing.get("attempt") == attempt


def wait_for_conversion(checkpoint: Path, attempt: str | None = None) -> None:
    """On the ranks other than 0: until rank 0's conversion is published, or has failed (its message raised here).
    Only `attempt`'s outcome counts: a node whose file system lags still saw an earlier start's failure marker after
    rank 0 had removed it, and stopped with that old error (exit 2, never requeued) while rank 0 converted; or an
    earlier universal/ that rank 0 had set aside, and went on to wait out the conversion in a collective."""
    while not (universal.has_universal(checkpoint) and converted_by(checkpoint, attempt)):
        try:
            failed = json.loads((checkpoint / FAILED).read_text())
        except (OSError, ValueError):  # none (yet), or one removed or written as it is read
            failed = None
        if isinstance(failed, dict) and (attempt is None or failed.get("attempt") == attempt):
            raise CheckpointError(str(failed.get("message")))
        time.sleep(POLL_S)


def ensure_universal(checkpoint: Path, accelerator, verify: Callable[[Path], list[str]]) -> None:
    """Every rank (a collective): `checkpoint` has its universal form when this returns, converted now if it had
    none or its files differ from the conversion's sizes or sha256 (`verify`, a collective, re-hashes them). Rank 0
    clears what an earlier, killed or failed, conversion left before anyone looks."""
    present = main_process_view(lambda: universal.has_universal(checkpoint))  # `verify` is a collective
    attempt = main_process_view(lambda: f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}")
    changed = verify(checkpoint) if present else None
    if changed == []:
        return
    if accelerator.is_main_process:
        for leftover in checkpoint.glob(f"{STAGING}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        (checkpoint / FAILED).unlink(missing_ok=True)
        set_aside_damaged(checkpoint, changed)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        convert(checkpoint, attempt=attempt)
    else:
        wait_for_conversion(checkpoint, attempt)
    accelerator.wait_for_everyone()

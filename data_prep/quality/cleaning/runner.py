"""Running the cleaning stages: on this machine (datatrove's local executor, one process per task up to `workers`) or
as dependent Slurm job arrays (datatrove's Slurm executor). Both continue a killed or failed run from the tasks it
had not finished, refuse a run whose settings or inputs differ from the ones the output was started with, and refuse
a second run into an output that another one is still writing."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from datatrove.executor import LocalPipelineExecutor
from datatrove.utils.word_tokenizers import load_word_tokenizer

from common.exit_codes import BAD_INPUT, DISK_FULL, FULL, RETRY, os_error_in
from common.files import atomic_write_text, fingerprint, fingerprint_change
from data_prep.quality.cleaning.report import REPORT_JSON
from data_prep.quality.cleaning.stages import CleanJob, stages
from data_prep.quality.cleaning.words import MemoTokenizer

SETTINGS = "settings.json"
SLURM_JOBS = "slurm_jobs.json"
LOG = "logs/clean.log"
PR_SET_PDEATHSIG = 1


class CleanError(RuntimeError):
    """A refusal or a failure the user can act on; the message says what and where. Exit 2: bad input, the same
    command fails the same way until a person changes something (docs/data-cleaning.md, "Exit codes")."""

    exit_code = BAD_INPUT


class CleanCrashed(CleanError):
    """A task process died (the OOM killer, a kill) or a task failed for a reason that is not its input's: exit 1,
    the code a scheduler requeues on; the same command continues from the tasks that finished."""

    exit_code = RETRY


class OutputFull(CleanError):
    """The output's filesystem is full (disk, quota, file-size limit): exit 4. Not the input's fault, and a rerun
    fails again until someone makes room: a person must act, as for training's failed save (also 4)."""

    exit_code = DISK_FULL


# Errors of the place, not of the moment: a directory this user cannot write, a read-only mount, a file in the way.
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR)


def output_error(error: BaseException, out: Path) -> CleanError | None:
    """A full disk (OutputFull) or an output that cannot be written (CleanError, exit 2) as one line; None when
    `error` is neither."""
    cause = os_error_in(error)
    if cause is None or cause.errno not in FULL + NOT_WRITABLE:
        return None
    where = cause.filename or "a file"
    if cause.errno in NOT_WRITABLE:
        if cause.filename and out not in (resolved := Path(cause.filename).resolve(), *resolved.parents):
            return None  # not the output's: an input, the environment
        return CleanError(f"--output {out}: cannot write {where} ({cause.strerror}); choose a directory this user can "
                          "create and write, or fix its permissions")  # fmt: skip
    existing = next(path for path in (out, *out.parents) if path.exists())
    free_gb = shutil.disk_usage(existing).free / 1e9
    return OutputFull(f"--output {out}: {cause.strerror} writing {where} ({free_gb:.1f} GB free); make room (or raise "
                      "the quota or file-size limit) and run the same command again: it continues from the tasks that "
                      "finished")  # fmt: skip


def stage_failure(error: BaseException, stage: str, work: Path) -> CleanError:
    """What a failed stage means for whoever runs the command again: a task's message about its input (exit 2), a
    full or unwritable output (4, 2), or a task that died or crashed (1: run the same command again)."""
    message = task_error(work)
    if message:
        return CleanError(message)
    if isinstance(error, BrokenProcessPool):
        return CleanCrashed(f"a task process of stage {stage} died (killed, or out of memory: see dmesg); run the same "
                            "command again to continue")  # fmt: skip
    return output_error(error, work.parent) or CleanCrashed(
        f"stage {stage} failed ({type(error).__name__}: {error}); run the same command again to continue (the log: "
        f"{work / LOG})"
    )


def settings_of(job: CleanJob) -> dict:
    return {
        "inputs": [str(Path(path).resolve()) for path in job.files],
        "config": job.config.to_dict(),
        "filter_order": [choice.name for choice in job.config.filters],  # dicts compare equal in any order
        "tasks": job.tasks,
        "text_field": job.text_field,
        "strict": job.strict,
        "skip_corrupt_files": job.skip_corrupt_files,
        "keep_removed": job.keep_removed,
    }


ABSENT = "absent"  # a setting or filter argument one of the two runs did not have


def changed_settings(recorded: dict, settings: dict) -> list[str]:
    """Each setting that differs, as `key: old -> new`, nested keys dotted (`config.filters.gopher_quality.
    min_stop_words: absent -> 3`); the inputs as the files added and removed. The filter order only when the same
    filters are chosen (a filter added or removed is named under config.filters)."""
    changes = []
    for key in settings:
        if key == "inputs":
            added = [path for path in settings[key] if path not in recorded.get(key, [])]
            removed = [path for path in recorded.get(key, []) if path not in settings[key]]
            if added or removed:
                changes.append(f"inputs: {_few(removed)} removed, {_few(added)} added")
            elif recorded.get(key) != settings[key]:
                changes.append("inputs: the same files in another order")
        elif key == "filter_order":
            if sorted(recorded.get(key, [])) == sorted(settings[key]) and recorded.get(key) != settings[key]:
                changes.append(f"filter_order: {', '.join(recorded[key])} -> {', '.join(settings[key])}")
        else:
            changes += _changed(key, recorded.get(key, ABSENT), settings[key])
    return changes


def _changed(key: str, old, new) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [change for name in [*old, *(name for name in new if name not in old)]
                for change in _changed(f"{key}.{name}", old.get(name, ABSENT), new.get(name, ABSENT))]  # fmt: skip
    return [] if old == new else [f"{key}: {_shown(key, old)} -> {_shown(key, new)}"]


def _shown(key: str, value) -> str:
    if value != ABSENT:
        return json.dumps(value)
    return "off" if key.startswith("config.filters.") and key.count(".") == 2 else ABSENT  # a filter left out is off


def _few(paths: list[str], shown: int = 3) -> str:
    if not paths:
        return "none"
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more


def prepare(job: CleanJob) -> bool:
    """Check `job` against what its output holds; True when the output is already complete. Records the settings
    and the inputs' fingerprints on a first start."""
    out, work = Path(job.out), job.work
    foreign = [path for path in out.iterdir() if path.name not in (".lock", work.name)] if out.exists() else []
    if foreign and not (work / SETTINGS).exists():
        raise CleanError(f"--output {out} holds files that are not a cleaning run's; choose a new or empty directory")
    settings = json.loads(json.dumps(settings_of(job)))  # as saved: tuples become lists
    if (work / SETTINGS).exists():
        recorded = json.loads((work / SETTINGS).read_text())
        changes = changed_settings(recorded, settings)
        if changes:
            raise CleanError(f"--output {out} was started with other settings: {'; '.join(changes)}; run the same "
                             "command to continue it, or use a new --output")  # fmt: skip
        for path, before in zip(job.files, recorded["input_fingerprints"], strict=True):
            change = fingerprint_change(path, before)
            if change:
                raise CleanError(f"--input {path} changed since {out} was started ({change}); clean into a new "
                                 "--output")  # fmt: skip
        return (out / REPORT_JSON).exists()
    work.mkdir(parents=True, exist_ok=True)
    settings["input_fingerprints"] = [fingerprint(path) for path in job.files]
    atomic_write_text(work / SETTINGS, json.dumps(settings, indent=2))
    return False


def _die_with_parent(parent_pid: int) -> None:
    """A task process is killed when the run's process goes (SIGKILL included), so that a killed run leaves no task
    writing into the output that the next run would also write."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)


_STAGE = None  # the executor of the stage being run; the forked task processes inherit it


def _run_task(rank: int) -> None:
    copy.deepcopy(_STAGE)._run_for_rank(rank)  # steps keep per-task state: a fresh copy for each task


def run_stage(executor: LocalPipelineExecutor, workers: int) -> None:
    """The stage's unfinished tasks, `workers` at a time, in processes forked from this one. (datatrove's own `run`
    starts a manager process that outlives a killed run, and its pool waits forever for a task whose process died.)
    The first failure stops the stage at once: the other task processes are killed, not waited for."""
    global _STAGE
    _STAGE = executor
    ranks = executor.get_incomplete_ranks()
    if not ranks:
        return
    # With fork, every worker is started at the first submit, by this (main) thread: PR_SET_PDEATHSIG fires when the
    # forking *thread* ends. A worker that dies (kill -9, the OOM killer) breaks the pool: an error, not a hang.
    pool = ProcessPoolExecutor(min(workers, len(ranks)), multiprocessing.get_context("fork"), _die_with_parent,
                               (os.getpid(),))  # fmt: skip
    try:
        for future in as_completed([pool.submit(_run_task, rank) for rank in ranks]):
            future.result()
    except BaseException:
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        raise
    finally:
        # Waited for (its task processes have ended or been killed: milliseconds): a pool manager thread still
        # closing its wake-up pipe at the interpreter's exit raced Python's exit hook writing to that pipe, and a
        # successful run printed "OSError: [Errno 9] Bad file descriptor" (1 run in 40, Python 3.11).
        pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def stderr_to(path: Path):
    """datatrove's and its task processes' log lines go to `path` (they print every task's pipeline and stats)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved, target = os.dup(2), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def clear_errors(work: Path) -> None:
    """The folder where a task leaves its message for bad input, emptied of an earlier run's."""
    for stale in (work / "errors").glob("*.txt"):
        stale.unlink()


def run_local(job: CleanJob, workers: int, log=print) -> None:
    """Every stage in turn on this machine; a stage's completed tasks are skipped."""
    clear_errors(job.work)
    log(f"log: {job.work / LOG}")
    # spaCy's import and tokenizers (~1.8 s) once here, inherited by every forked task process, not paid in each:
    # datatrove's (its filters' own, for a language the shared splitter leaves to it) and the shared splitter's
    load_word_tokenizer(job.config.language).word_tokenize("warm up")
    MemoTokenizer(job.config.language).word_tokenize("warm up")
    with stderr_to(job.work / LOG):
        for stage in stages(job):
            started = time.perf_counter()
            executor = LocalPipelineExecutor(stage.pipeline, tasks=stage.tasks,
                                             logging_dir=str(job.work / "stages" / stage.name))  # fmt: skip
            try:
                run_stage(executor, workers)
            except Exception as error:  # BrokenProcessPool included: a task process died
                raise stage_failure(error, stage.name, job.work) from None
            missing = executor.get_incomplete_ranks()
            if missing:
                raise CleanCrashed(f"stage {stage.name}: tasks {missing[:10]} did not complete; run the same command "
                                   f"again (the log: {job.work / LOG})")  # fmt: skip
            log(f"{stage.name}: {stage.tasks} task(s) done in {time.perf_counter() - started:.1f} s")


def task_error(work: Path) -> str | None:
    """The message a task left for bad input (the first by rank), if any."""
    found = sorted((work / "errors").glob("*.txt"))
    return found[0].read_text() if found else None


@dataclass(frozen=True)
class SlurmOptions:
    partition: str
    time: str = "24:00:00"
    cpus_per_task: int = 1
    mem_per_cpu_gb: int = 2
    venv: str | None = None  # bin/activate of the environment every node runs; default: this one
    qos: str | None = None
    sbatch_args: dict = field(default_factory=dict)


def submit_slurm(job: CleanJob, options: SlurmOptions, log=print) -> list[str]:
    """The stages as dependent job arrays (each waits for the one before to succeed); returns their job ids. The
    caller has checked that no job of an earlier submission still lives."""
    from datatrove.executor import SlurmPipelineExecutor

    clear_errors(job.work)
    venv = options.venv or str(Path(sys.prefix) / "bin" / "activate")
    previous, executors = None, []
    for stage in stages(job):
        previous = SlurmPipelineExecutor(
            stage.pipeline, tasks=stage.tasks, time=options.time, partition=options.partition,
            cpus_per_task=options.cpus_per_task, mem_per_cpu_gb=options.mem_per_cpu_gb, qos=options.qos or "",
            job_name=f"clean-{stage.name}", venv_path=venv, sbatch_args=dict(options.sbatch_args),
            logging_dir=str(job.work / "stages" / stage.name), depends=previous,
        )  # fmt: skip
        executors.append((stage, previous))
    with stderr_to(job.work / LOG):
        try:
            previous.run()
        except subprocess.CalledProcessError as error:
            raise CleanError(f"sbatch refused a job ({error}); the stages submitted before it are recorded and "
                             f"named by the next run; see {job.work / LOG}") from None  # fmt: skip
        finally:  # also when a later submission failed: the jobs already queued must be known to the next run
            ids = [str(executor.job_id) for _, executor in executors if executor.job_id not in (None, -1)]
            atomic_write_text(job.work / SLURM_JOBS, json.dumps(ids))
    for stage, executor in executors:
        state = "already complete" if executor.job_id == -1 else f"job {executor.job_id}"
        log(f"{stage.name}: {stage.tasks} task(s), {state}")
    return ids


def live_slurm_jobs(work: Path) -> list[str]:
    """The recorded jobs of this output that Slurm still has pending or running. A job left waiting on a dependency
    that failed never runs: it is cancelled here, not counted."""
    try:
        ids = json.loads((work / SLURM_JOBS).read_text())
    except (OSError, ValueError):
        return []
    if not ids:
        return []
    live = []
    for line in _squeue(ids).splitlines():
        job_id, state, reason = (line.split(maxsplit=2) + ["", ""])[:3]
        if state == "PENDING" and "DependencyNeverSatisfied" in reason:
            subprocess.run(["scancel", job_id], check=False)
        elif state not in ENDED:
            live.append(job_id.split("_")[0])
    return sorted(set(live))


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE", "SPECIAL_EXIT"}  # fmt: skip


def _squeue(ids: list[str], tries: int = 3) -> str:
    """squeue's lines for these jobs ("" when Slurm has forgotten them all); an unanswered question is an error, not
    "no job": a second run must not start while the first's jobs may be running."""
    command = ["squeue", "-h", "-o", "%i %T %r", "-j", ",".join(ids)]
    for attempt in range(tries):
        try:
            listed = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise CleanError(f"this output has Slurm jobs ({', '.join(ids)}) and squeue is not here to say whether "
                             "they still run; continue it from a Slurm submit host (or, once they are known to have "
                             f"ended, delete {SLURM_JOBS} in the output's .clean/)") from None  # fmt: skip
        except subprocess.TimeoutExpired:
            listed = subprocess.CompletedProcess(command, 1, "", "squeue timed out")
        if listed.returncode == 0 or "Invalid job id" in listed.stderr:
            return listed.stdout if listed.returncode == 0 else ""
        time.sleep(5 * (attempt < tries - 1))
    raise CleanCrashed(f"squeue could not say whether this output's jobs still run ({listed.stderr.strip()}); try "
                       "again")  # fmt: skip

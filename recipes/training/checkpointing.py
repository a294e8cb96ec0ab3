"""Checkpoints that survive a kill at any moment, and the final export.

A save goes: every rank writes its ZeRO-3 shards into `.checkpoint-N.tmp/`; all ranks meet; each
rank hashes its own files; the main process writes `manifest.json` last and renames the directory
to `checkpoint-N`, then replaces the `latest` pointer atomically. A directory without a manifest
whose files match it is never loaded. Old checkpoints are deleted only after the new one is
published, never fewer than two are kept, and the best one by eval loss is protected.

Every function that takes the accelerator is called on every rank: saving ZeRO-3 state and
gathering full weights are collectives. File moves and deletions happen on the main process,
between barriers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import yaml

from common.collectives import main_process_view, ranks_where
from common.files import atomic_write_text, replace_directory, sha256_of, sync_tree
from common.lock import held_by_someone
from recipes.training.mapped_load import mapped_loads

logger = logging.getLogger("pretrain")
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
RANK_FILE_PATTERN = re.compile(r"(?:rank_|random_states_)(\d+)")
MANIFEST = "manifest.json"
LATEST = "latest"
RESOLVED_CONFIG = "config.yaml"
# The run's own copy of its tokenizer, in output_dir: an export from disk uses it by default (its source may change)
TOKENIZER_COPY = "tokenizer"
TRAINER_STATE = "trainer_state.json"  # run state and data position, written by the main process
MIN_KEPT = 2
UNIVERSAL_DIR = "universal"  # where `ds_to_universal` output goes inside a checkpoint, for world-size changes


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for, or is the newest, and cannot be used; the message says why."""


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank (a full disk, say); nothing was published or deleted."""


def step_of(path: Path) -> int | None:
    match = CHECKPOINT_PATTERN.match(path.name)
    return int(match.group(1)) if match else None


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """Directories named like published checkpoints, oldest first (complete or not)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(step_of(p), p) for p in output_dir.iterdir() if p.is_dir() and step_of(p) is not None]
    return [p for _, p in sorted(found)]


def owned_files(directory: Path, rank: int, world_size: int) -> list[Path]:
    """The files this rank hashes: those named for it (ZeRO shards, RNG states); rank 0 also takes the rest."""
    mine = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        match = RANK_FILE_PATTERN.search(path.name)
        owner = int(match.group(1)) if match and int(match.group(1)) < world_size else 0
        if owner == rank:
            mine.append(path)
    return mine


def manifest_problems(directory: Path) -> list[str]:
    """Why `directory` is not a complete checkpoint (empty list: it is). Checks the manifest's shape, and every
    file's presence and size; `verify_share` re-hashes the files for a full check."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return [f"{directory} has no {MANIFEST}: the save that wrote it did not finish"]
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return [f"{manifest_path} is not valid JSON ({error})"]
    shape_ok = isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) and manifest["files"]
    if not shape_ok or not isinstance(manifest.get("world_size"), int) or not isinstance(manifest.get("step"), int):
        return [f"{manifest_path} is not a checkpoint manifest (it needs step, world_size and a non-empty files map)"]
    problems = []
    for name, entry in manifest["files"].items():
        path = directory / name
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or "sha256" not in entry:
            problems.append(f"{manifest_path}: the entry of {name} has no bytes and sha256")
        elif not path.is_file():
            problems.append(f"{path} is listed in the manifest but missing")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(f"{path} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}")
    return problems


def verify_checksums(directory: Path) -> list[str]:
    """Every file's sha256 against the manifest, in this process."""
    return verify_share(directory, 0, 1)


def verify_share(directory: Path, rank: int, world_size: int) -> list[str]:
    """Re-hash this rank's share of the manifest's files and name those that differ. Shares are balanced by
    bytes, so N ranks verify a checkpoint in about 1/N of the time one would take."""
    return verify_files(directory, read_manifest(directory)["files"], rank, world_size, "the manifest")


def verify_on_every_rank(accelerator, directory: Path, share=None) -> list[str]:
    """Every file of `directory` against its manifest (or what `share(directory, rank, world_size)` checks), each rank
    re-hashing its share (a collective); the problems found on any rank, on every rank."""
    from accelerate.utils import gather_object

    share = share or verify_share
    try:
        mine = share(directory, accelerator.process_index, accelerator.num_processes)
    except OSError as error:  # on this rank alone (a lagging node, EIO): a problem, not a rank missing from the gather
        mine = [f"{directory}: rank {accelerator.process_index} could not read it ({error})"]
    return [problem for part in gather_object([mine]) for problem in part]


def verify_files(root: Path, files: dict[str, dict], rank: int, world_size: int, record: str) -> list[str]:
    loads = [0] * world_size
    problems = []
    for name, entry in sorted(files.items(), key=lambda item: (-item[1]["bytes"], item[0])):
        owner = loads.index(min(loads))  # the least loaded rank takes the next largest file
        loads[owner] += entry["bytes"]
        if owner == rank and sha256_of(root / name) != entry["sha256"]:
            problems.append(f"{root / name}: sha256 differs from {record} (the file was changed or damaged)")
    return problems


def resume_candidates(output_dir: str | Path, resume: str) -> list[Path]:
    """Checkpoints to try, newest first: the one asked for, or every `checkpoint-N` of output_dir ("auto")."""
    if resume == "none":
        return []
    if resume != "auto":
        return [Path(resume)]
    return list(reversed(checkpoint_dirs(output_dir)))


def read_manifest(directory: Path) -> dict[str, Any]:
    return json.loads((Path(directory) / MANIFEST).read_text())


def find_resume_checkpoint(
    output_dir: str | Path, resume: str, verify: Callable[[Path], list[str]] = verify_checksums, agree=lambda x: x
) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from, and notes on what was passed over.

    `resume` is "auto" (the newest complete checkpoint of output_dir whose files match their checksums; none there is
    a fresh start, and none that can be used a CheckpointError), "none", or a path (which must be complete and match,
    else CheckpointError). `verify` re-hashes a candidate (split over the ranks); `agree` gives every rank the main
    process's view (a lagging node's differs)."""
    notes, candidates = [], agree(resume_candidates(output_dir, resume))
    for path in candidates:
        problems = agree(manifest_problems(path) if path.is_dir() else [f"{path} does not exist"])
        problems = problems or verify(path)
        if not problems:
            return path, notes
        if resume != "auto":
            raise CheckpointError("cannot resume from the requested checkpoint: " + "; ".join(problems))
        notes.append(
            f"skipped {path.name}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if problems[1:] else "")
        )
    # a used output_dir (a checkpoint of this package's is there): starting over would train from step 0 over a run's
    # history, unasked. Directories named like checkpoints without a manifest alone (another tool's) are passed over
    if notes and agree(any((path / MANIFEST).is_file() for path in candidates)):
        raise CheckpointError(
            f"no checkpoint in {output_dir} can be resumed: " + "; ".join(notes) + ". Restore one (or pass "
            "--resume PATH to one elsewhere), or start over with --resume none and overwrite_output_dir: true"
        )
    return None, notes


def newer_than_requested(output_dir: str | Path, requested: Path) -> Path | None:
    """The newest complete checkpoint of `output_dir` when it is past the step of `requested` (an explicit
    `--resume PATH`), else None. Continuing from the older one there would mix two trajectories: rotation keeps the
    higher steps (and deletes the new saves), and `--resume auto` later picks the abandoned run's newest."""
    if requested.is_dir() and manifest_problems(requested):
        return None  # what is wrong with the request itself is said where it is loaded
    # gone (rotation deletes a job's --resume checkpoint once it has saved enough): any complete one is later
    step = read_manifest(requested)["step"] if requested.is_dir() else -1
    newer = [path for path in checkpoint_dirs(output_dir) if step_of(path) > step and not manifest_problems(path)]
    return newer[-1] if newer else None


def checkpoints_to_delete(
    complete: list[Path], save_total_limit: int | None, protected: Path | None = None
) -> list[Path]:
    """All but the newest `save_total_limit` (at least MIN_KEPT), oldest first; the protected (best)
    checkpoint is kept on top of those when it is older."""
    if save_total_limit is None:
        return []
    kept = {p.resolve() for p in complete[-max(save_total_limit, MIN_KEPT) :]}
    if protected is not None:
        kept.add(protected.resolve())
    return [p for p in complete if p.resolve() not in kept]


def resolved_config_text(config_dict: dict[str, Any]) -> str:
    return yaml.safe_dump(config_dict, sort_keys=False)


def write_resolved_config(directory: Path, config_dict: dict[str, Any]) -> None:
    (directory / RESOLVED_CONFIG).write_text(resolved_config_text(config_dict))


def save_checkpoint(accelerator, output_dir: str | Path, step: int, state: dict[str, Any], run_files: dict[str, str],
                    progress: Callable[[], None] = lambda: None) -> Path:  # fmt: skip
    """Write and publish `checkpoint-{step}`; see the module docstring for the order of events. The main process
    writes `state` to trainer_state.json and each of `run_files` (name -> text: the resolved recipe, ...).
    `progress` is called between the phases and after each file hashed (the hang watchdog's beat)."""
    output_dir = Path(output_dir)
    staging = output_dir / f".checkpoint-{step}.tmp"
    short = space_problem(output_dir)
    if ranks_where(short is not None, accelerator.device):  # before any rank writes: see space_problem
        raise CheckpointSaveError(f"checkpoint-{step} not saved: {short or 'too little space on another rank'}. Make "
                                  "room (or lower save_total_limit) and relaunch: the run resumes from the previous "
                                  "checkpoint, which is intact")  # fmt: skip
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    failure = ""
    progress()
    try:
        accelerator.save_state(str(staging))  # collective: each rank writes its own ZeRO-3 shards
        if accelerator.is_main_process:
            for name, text in run_files.items():
                (staging / name).write_text(text)
            (staging / TRAINER_STATE).write_text(json.dumps({"global_step": step, **state}, indent=2))
    except (OSError, RuntimeError) as error:  # ENOSPC, EFBIG, EIO; torch.save reports them as RuntimeError
        failure = f"{type(error).__name__}: {error}"
    failed_ranks = ranks_where(bool(failure), accelerator.device)
    if failed_ranks:
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)  # give the space back; nothing was published
        accelerator.wait_for_everyone()
        latest = output_dir / LATEST
        previous = latest.read_text().strip() if latest.exists() else "none"
        free_gb = shutil.disk_usage(output_dir).free / 1e9
        raise CheckpointSaveError(
            f"saving checkpoint-{step} failed on rank(s) {failed_ranks}" + (f" ({failure})" if failure else "")
            + f"; {free_gb:.1f} GB free in {output_dir}. Nothing was published or deleted: the previous "
            f"checkpoint ({previous}) is intact and a relaunch resumes from it"
        )  # fmt: skip
    progress()
    return _publish(accelerator, staging, output_dir / f"checkpoint-{step}", step, progress)


def space_problem(output_dir: Path, margin: float = 1.05) -> str | None:
    """Why the next save would not fit: the free space against the newest complete checkpoint's size (None: it fits,
    or there is none yet). Checked by every rank before any writes: a disk that filled on some ranks only left those
    in the failure's all-reduce and the others in DeepSpeed's barrier, a hang instead of exit 4."""
    try:  # every rank answers: an error here on one rank alone would leave the others in the all-reduce
        latest = output_dir / LATEST
        newest = output_dir / latest.read_text().strip() if latest.is_file() else None
        needed = sum(entry["bytes"] for entry in read_manifest(newest)["files"].values()) * margin if newest else 0
        free = shutil.disk_usage(output_dir).free
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # nothing to go by: the save itself says what is wrong
    if free >= needed:
        return None
    size_gb = needed / margin / 1e9
    return f"{free / 1e9:.1f} GB free in {output_dir}, and a checkpoint takes {size_gb:.1f} GB ({newest.name})"


def _publish(accelerator, staging: Path, final: Path, step: int, progress: Callable[[], None]) -> Path:
    """Hash, write the manifest last, rename, point `latest` at it (a collective; moves on the main process)."""
    from accelerate.utils import gather_object

    # Each rank syncs to storage and hashes the shards it wrote, in parallel (at 70B each holds ~104 GB of the ~830 GB):
    # without the sync, a power loss after the rename below could leave a published checkpoint of empty files
    failure, mine = "", {}
    try:
        for path in owned_files(staging, accelerator.process_index, accelerator.num_processes):
            mine[str(path.relative_to(staging))] = {"bytes": path.stat().st_size, "sha256": sha256_of(path, sync=True)}
            progress()
    except OSError as error:  # EIO from the sync: on this rank alone, and the others are in the gather below
        failure = f"rank {accelerator.process_index}: {type(error).__name__}: {error}"
    files: dict[str, Any] = {}
    for part in gather_object([mine]):
        files.update(part)
    if accelerator.is_main_process and not failure:
        try:  # a full disk here raised on the main process only, the others waiting in the barrier below
            manifest = {"step": step, "world_size": accelerator.num_processes, "files": dict(sorted(files.items())),
                        "slurm_job_id": os.environ.get("SLURM_JOB_ID")}  # fmt: skip
            sync_tree(staging)  # the names of every rank's files, before the manifest vouches for them
            atomic_write_text(staging / MANIFEST, json.dumps(manifest, indent=2))
            replace_directory(staging, final)  # a checkpoint of this step saved before a rollback or resume
            atomic_write_text(final.parent / LATEST, final.name + "\n")
        except OSError as error:
            failure = f"{type(error).__name__}: {error}"
    failed_ranks = ranks_where(bool(failure), accelerator.device)
    if failed_ranks:
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        said = failure or "see its log"
        raise CheckpointSaveError(f"publishing checkpoint-{step} failed on rank(s) {failed_ranks} ({said}); a relaunch "
                                  "resumes from the newest complete checkpoint")  # fmt: skip
    accelerator.wait_for_everyone()
    return final


def remove_checkpoint(path: Path) -> None:
    """Rename `path` to `.checkpoint-N.deleting`, then delete it (a leftover of a killed deletion: `deleting`)."""
    doomed = path.with_name(f".{path.name}.deleting")
    try:
        shutil.rmtree(doomed, ignore_errors=True)  # an earlier deletion's leftover of the same name
        os.replace(path, doomed)
    except OSError as error:  # on the main process alone, the others waiting in a barrier: delete in place
        logger.warning("rotation: could not rename %s (%s); deleting it in place", path.name, error)
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)


def deleting(output_dir: Path) -> list[Path]:
    """What deletions killed half-way left in `output_dir` (no longer checkpoints: removed at the next start)."""
    return sorted(output_dir.glob(".checkpoint-*.deleting"))


def reader_pin(checkpoint: Path) -> Path:
    """The file a reader of `checkpoint` (an export) holds a shared flock on; rotation leaves a held one alone. Beside
    the checkpoint, not in it: the checkpoint's files are the manifest's."""
    return checkpoint.parent / f".{checkpoint.name}.readers"


def export_staging(output: Path) -> tuple[Path, Path]:
    """An export to `output` writes into the staging directory beside it (never named like a save's `.checkpoint-N.tmp`,
    which rotation removes), renamed into place when complete, and holds the lock beside it: (staging, lock)."""
    return output.with_name(f".export-{output.name}.tmp"), output.with_name(f".{output.name}.export-lock")


def rotate_checkpoints(accelerator, output_dir: str | Path, save_total_limit: int | None, best: Path | None,
                       progress: Callable[[], None] = lambda: None):  # fmt: skip
    """Delete the oldest complete checkpoints beyond the limit, except one being read (an export holds its pin: it
    goes at a later rotation); incomplete leftovers of killed saves too. A checkpoint is renamed out of the pattern
    first: a deletion killed half-way leaves a `.checkpoint-N.deleting` the next start removes, not a `checkpoint-N`
    with missing files that no rotation would count again (~830 GB each at 70B)."""
    output_dir = Path(output_dir)
    doomed: list[Path] = []
    # Only the main process scans: another rank listing the directory while it is being deleted
    # would trip over vanishing files.
    if accelerator.is_main_process:
        complete = [p for p in checkpoint_dirs(output_dir) if not manifest_problems(p)]
        doomed = checkpoints_to_delete(complete, save_total_limit, best)
        for path in list(doomed):
            if held_by_someone(reader_pin(path)):
                logger.info("rotation: keeping %s for now, an export is reading it", path.name)
                doomed.remove(path)
                continue
            remove_checkpoint(path)
            reader_pin(path).unlink(missing_ok=True)
            progress()
        newest = complete[-1] if complete else None
        for leftover in output_dir.glob(".checkpoint-*.tmp"):
            if newest is None or leftover.name != f".{newest.name}.tmp":
                shutil.rmtree(leftover, ignore_errors=True)
    accelerator.wait_for_everyone()
    return doomed


def read_config(directory: Path) -> dict[str, Any]:
    """The resolved recipe a checkpoint (or an export) was saved with."""
    return yaml.safe_load((Path(directory) / RESOLVED_CONFIG).read_text())


def read_trainer_state(directory: Path) -> dict[str, Any]:
    return json.loads((Path(directory) / TRAINER_STATE).read_text())


class Stateful(Protocol):
    """A part of the run that saves itself into trainer_state.json. `state_dict` is called on every rank
    (it may gather); the main process's answer is written. `load_state_dict` gets that answer on every rank."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Checkpointer:
    """Saves and loads the checkpoints of one run: the accelerator's state (each rank's ZeRO-3 model and
    optimizer shards, RNG states) and the stateful parts it was given by name (the run state, the data
    position), without knowing what is inside them. Every method is a collective: call it on every rank."""

    def __init__(self, accelerator, engine, output_dir: str | Path, save_total_limit: int | None,
                 run_files: dict[str, str], stateful: dict[str, Stateful], last: Path | None = None):  # fmt: skip
        self.accelerator, self.engine = accelerator, engine
        self.output_dir, self.save_total_limit, self.run_files = Path(output_dir), save_total_limit, run_files
        self.stateful = stateful
        self.last = last  # the newest checkpoint this run published or resumed from
        # a load that kept some parts as they were (a rollback keeps the data position past the spike): the run's
        # state is no longer `last`'s at the same step, and a save there (a stop signal's) must write it again
        self.moved_on = False
        self.verified: set[Path] = set()  # what this launch hashed: its own saves, and the checkpoint it loaded
        self.progress: Callable[[], None] = lambda: None  # called through saves and loads (the hang watchdog's beat)

    def save(self, step: int, protected: str | None = None) -> Path:
        """Publish `checkpoint-{step}` and rotate, keeping `protected` (the best); nothing if it is the newest."""
        if self.is_current(step):
            return self.last
        state = {name: part.state_dict() for name, part in self.stateful.items()}
        path = save_checkpoint(self.accelerator, self.output_dir, step, state, self.run_files, self.progress)
        best = self.output_dir / protected if protected else None
        rotate_checkpoints(self.accelerator, self.output_dir, self.save_total_limit, best, self.progress)
        self.last, self.moved_on = path, False
        self.verified.add(path)
        return path

    def is_current(self, step: int) -> bool:
        """Whether `last` holds the run as it is at `step` (a save there would write nothing new)."""
        return self.last is not None and step_of(self.last) == step and not self.moved_on

    def verify(self, path: Path) -> list[str]:
        """What is wrong with `path` ([]: nothing), re-hashed by every rank unless this launch saved or loaded it."""
        if path in self.verified:
            return []
        problems = main_process_view(lambda: manifest_problems(path) if path.is_dir() else [f"{path} does not exist"])
        problems = problems or verify_on_every_rank(self.accelerator, path)
        if not problems:
            self.verified.add(path)
        return problems

    def load(self, path: Path, skip: tuple[str, ...] = ()) -> bool:
        """Model, optimizer, RNG states and every stateful part not in `skip`, as saved in `path`; returns
        whether it was saved by this many processes. If not, it loads the universal checkpoint (DeepSpeed then
        needs `checkpoint.load_universal`, set before the engine is built; per-rank RNG states do not carry over)."""
        same_world = read_manifest(path)["world_size"] == self.accelerator.num_processes
        # DeepSpeed reads the format from its config at each load: a launch that resumed from universal/ and later
        # rolls back to one of its own checkpoints loads the ordinary format (it crashed in the universal loader)
        self.engine._config.load_universal_checkpoint = not same_world
        self.progress()
        if same_world:
            with mapped_loads(self.engine):  # a resume's host peak is the steady state's (recipes.training.mapped_load)
                self.accelerator.load_state(str(path))  # every rank loads its own shards and RNG states
        else:
            self.engine.load_checkpoint(str(path / UNIVERSAL_DIR), tag="pytorch_model")
        self.progress()
        saved = read_trainer_state(path)
        for name, part in self.stateful.items():
            if name not in skip:
                part.load_state_dict(saved[name])
        self.last, self.moved_on = path, bool(skip)
        self.verified.add(path)  # a resume re-hashes what it loads (recipes.training.resume), a rollback loads `last`
        return same_world

"""The output directory belongs to one run at a time: the lock, and the rules for a fresh start in a used one."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import shutil
from pathlib import Path

from common.collectives import on_main_process
from common.files import replace_directory, replaced_aside, restore_replaced, sync_tree, tree_bytes
from common.lock import DirectoryLock, FileLock, LockedError, describe
from recipes.config import ConfigError, PretrainConfig
from recipes.training import checkpointing, elastic
from recipes.training.callbacks import Benchmarks
from recipes.training.checkpointing import TOKENIZER_COPY

logger = logging.getLogger("pretrain")

# What a run writes into output_dir; `overwrite_output_dir` removes exactly these, nothing a user put beside them.
RUN_OUTPUTS = (
    "metrics.jsonl", "tensorboard", "final", "eval", "loss.png", "report.md", "run_summary.json",
    checkpointing.RESOLVED_CONFIG, "deepspeed_config.json", checkpointing.LATEST, "trackers.json", "mlruns", "wandb",
    Benchmarks.RUNNING_MARKER, TOKENIZER_COPY,
)  # fmt: skip


def lock(config: PretrainConfig) -> DirectoryLock | None:
    """Take output_dir for this run before anything is written (global rank 0 holds it; a collective)."""

    def take() -> DirectoryLock:
        try:
            with disk_errors_named(Path(config.output_dir)):
                held = DirectoryLock(config.output_dir, "training run").acquire()
        except LockedError as error:
            raise ConfigError(f"output_dir: {error}") from None
        if held.took_over:
            logger.warning("output_dir: took over the lock of a dead run (%s)", describe(held.took_over))
        # now, before an elastic conversion writes ~830 GB beside them at 70B
        for staging, size in remove_stale_checkpoint_staging(Path(config.output_dir)):
            logger.warning("removed %s (%.1f GB), left by a save, deletion or conversion that was killed", staging,
                           size / 1e9)  # fmt: skip
        for aside, size in kept_aside(Path(config.output_dir)):  # never deleted by the run, and not in its disk plan
            logger.warning("%s (%.1f GB) was set aside as damaged; delete it once you do not need it", aside,
                           size / 1e9)  # fmt: skip
        return held

    return on_main_process(take, catch=(ConfigError,))


def check_fresh_start(config: PretrainConfig) -> None:
    """`--resume none` into a directory that holds checkpoints would mix two runs (rotation keeps the old run's
    higher steps, and `--resume auto` would later pick them): refused unless `overwrite_output_dir` clears it."""
    output_dir = Path(config.output_dir)
    previous = checkpointing.checkpoint_dirs(output_dir)
    if config.resume_from_checkpoint != "none" or not previous:
        return
    if not config.overwrite_output_dir:
        raise ConfigError(
            f"--resume none, but {output_dir} holds checkpoints of another run ({previous[-1].name}, ...): resume "
            "it (--resume auto), choose a new output_dir, or set overwrite_output_dir: true to delete that run"
        )
    doomed = [*previous, *output_dir.glob(".checkpoint-*.tmp"), *(output_dir / name for name in RUN_OUTPUTS)]
    refuse_deleting_inputs(config, [path for path in doomed if path.exists()])
    for path in doomed:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    logger.warning("overwrite_output_dir: removed the previous run in %s (%d checkpoints)", output_dir, len(previous))


def refuse_deleting_inputs(config: PretrainConfig, doomed: list[Path]) -> None:
    """A run continued from its own `final/` (model_name_or_path), or reading a tokenizer or data kept under the old
    run's outputs, would lose its input to `overwrite_output_dir` halfway through its start."""
    for key, source in read_paths(config):
        for path in doomed:
            if source.resolve().is_relative_to(path.resolve()):
                raise ConfigError(f"overwrite_output_dir would delete {path}, which {key} reads ({source}): copy it "
                                  "elsewhere first, or choose a new output_dir")  # fmt: skip


def read_paths(config: PretrainConfig) -> list[tuple[str, Path]]:
    """The local paths the run reads, by key (a glob by the directory before its first wildcard)."""
    named = [("tokenizer_name_or_path", config.tokenizer_name_or_path),
             ("model_name_or_path", config.model_name_or_path), ("mmlu_dir", config.mmlu_dir),
             ("gsm8k_dir", config.gsm8k_dir),
             *(("train_files", name) for name in config.train_files or []),
             *(("train_mixture", entry.get("path")) for entry in config.train_mixture or []),
             *(("validation_files", name) for name in config.validation_files)]  # fmt: skip
    paths = []
    for key, name in named:
        if isinstance(name, str) and name:
            fixed = Path(name.split("*")[0].split("?")[0].split("[")[0] or ".")
            paths.append((key, fixed if fixed.exists() else fixed.parent))
    return paths


def prepare(config: PretrainConfig, ds_config: dict, tokenizer) -> None:
    """Once every check has passed (main process): clear a previous run if asked to, and write the resolved
    recipe, the DeepSpeed config and a copy of the tokenizer beside the run's outputs."""
    output_dir = Path(config.output_dir)
    for staging, size in remove_stale_export_staging(output_dir):  # first: a final/ it puts back is a run output
        logger.warning("removed %s (%.1f GB), left by an export that was killed (final/ or one beside the "
                       "checkpoints)", staging, size / 1e9)  # fmt: skip
    check_fresh_start(config)
    with disk_errors_named(output_dir):
        checkpointing.write_resolved_config(output_dir, config.to_dict())
        (output_dir / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=2, default=str))
        keep_tokenizer(output_dir, tokenizer, config.tokenizer_name_or_path)


def remove_stale_export_staging(directory: Path) -> list[tuple[Path, int]]:
    """Staging directories in `directory` left by exports that were killed (no process holds their lock), removed:
    at 70B one is ~140 GB of hidden files; an export killed while replacing its output gets the old one back
    (`put_back`). Returns what was removed, with its bytes."""
    removed = []
    for lock in sorted(directory.glob(".*.export-lock")):
        output = lock.with_name(lock.name.removeprefix(".").removesuffix(".export-lock"))
        stagings, aside = export_stagings(output), replaced_aside(output)
        if not stagings and not aside.is_dir():
            continue
        try:  # held while removing, as an export holds it: one starting meanwhile is refused, not removed under
            with FileLock(lock, what="a starting run removing a killed export's staging"):
                removed += put_back(aside) + [(staging, remove_tree(staging)) for staging in stagings]
        except LockedError:  # an export at work
            continue
    return removed


def export_stagings(output: Path) -> list[Path]:
    """The staging directories of exports to `output` that exist: this version's (`checkpointing.export_staging`) and
    the name earlier versions gave it, `.NAME.tmp` (unless NAME is a checkpoint's: that is a save's staging)."""
    earlier = [] if checkpointing.step_of(output) is not None else [output.with_name(f".{output.name}.tmp")]
    return [path for path in [checkpointing.export_staging(output)[0], *earlier] if path.is_dir()]


def put_back(aside: Path, whole=lambda path: True) -> list[tuple[Path, int]]:
    """`restore_replaced` of `aside` (if there is one), saying what it put back; [] or what it removed instead."""
    if not aside.is_dir():
        return []
    path, size, restored = restore_replaced(aside, whole)
    if restored:
        logger.warning("put %s (%.1f GB) back: a replacement of it was killed between its two renames", path,
                       size / 1e9)  # fmt: skip
        return []
    return [(path, size)]


def remove_stale_checkpoint_staging(output_dir: Path) -> list[tuple[Path, int]]:
    """What killed saves (`.checkpoint-N.tmp`, up to ~830 GB of hidden files at 70B), rotations
    (`.checkpoint-N.deleting`) and universal conversions left, removed at a start, where no save of this directory
    can be at work (the run holds its lock); what a replacement killed half-way set aside goes back or goes
    (`put_back`: a checkpoint only when its files match its manifest). Returns what was removed, with its bytes."""
    removed = []
    for aside in sorted(output_dir.glob(".checkpoint-*.replaced")):  # first: the staging of its replacement goes below
        if checkpointing.step_of(Path(aside.name[1:].removesuffix(".replaced"))) is not None:  # an export's: below
            removed += put_back(aside, lambda path: not checkpointing.manifest_problems(path))
    removed += put_back(replaced_aside(output_dir / TOKENIZER_COPY))
    conversions = sorted(output_dir.glob(f"checkpoint-*/{elastic.STAGING}*"))  # killed ones, ~830 GB each at 70B
    for staging in sorted(output_dir.glob(".checkpoint-*.tmp")) + checkpointing.deleting(output_dir) + conversions:
        removed.append((staging, remove_tree(staging)))
    return removed


def kept_aside(output_dir: Path) -> list[tuple[Path, int]]:
    """Damaged checkpoints and universal conversions the run set aside, with their bytes."""
    found = sorted(output_dir.glob("checkpoint-*.damaged*")) + sorted(
        output_dir.glob("checkpoint-*/universal.damaged*")
    )
    return [(path, tree_bytes(path)) for path in found if path.is_dir()]


def remove_tree(directory: Path) -> int:
    """Remove `directory`; returns the bytes its files held (for the warning that says what went)."""
    size = tree_bytes(directory)
    shutil.rmtree(directory, ignore_errors=True)
    return size


def keep_tokenizer(output_dir: Path, tokenizer, loaded_from: str) -> None:
    """`output_dir/tokenizer`: the tokenizer this run trains with, written atomically once (a resume finds the same
    one there: the run's identity refuses another tokenizer)."""
    from data_prep.packing.format import tokenizer_identity

    copy = output_dir / TOKENIZER_COPY
    if Path(loaded_from).resolve() == copy.resolve():
        return
    if copy.is_dir():
        from data_prep.tokenizer.loading import TokenizerLoadError, load_tokenizer

        try:
            kept = load_tokenizer(str(copy), "the run's tokenizer copy")
        except TokenizerLoadError:
            kept = None
        same = kept is not None and tokenizer_identity(kept, copy) == tokenizer_identity(tokenizer, copy)
        if same:
            return
        logger.warning("%s does not hold the tokenizer this run trains with: written again", copy)
    staging = output_dir / f".{TOKENIZER_COPY}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer.save_pretrained(staging)
    sync_tree(staging, files=True)  # an export from disk trusts this copy: on storage before it takes the name
    replace_directory(staging, copy)


# Errors of the place, not of the moment: another launch fails the same way, so they are bad input (exit 2, which
# a scheduler does not requeue), said in one line.
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR)


@contextlib.contextmanager
def disk_errors_named(output_dir: Path):
    """A full disk or quota, or a directory this user cannot write, while a launch writes its first files: one line
    (with the free space), not a traceback (a full disk during training is a failed save: exit 4, the previous
    checkpoint intact)."""
    try:
        yield
    except OSError as error:
        where = error.filename or "a file"
        if error.errno in NOT_WRITABLE:
            raise ConfigError(
                f"output_dir {output_dir}: cannot write {where} ({error.strerror}); choose a directory this user can "
                "create and write, or fix its permissions"
            ) from None
        if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        free_gb = shutil.disk_usage(output_dir).free / 1e9 if output_dir.exists() else float("nan")
        raise ConfigError(
            f"output_dir {output_dir}: {error.strerror} writing {where} ({free_gb:.1f} GB free); "
            "make room and relaunch: the run resumes from its last checkpoint"
        ) from None

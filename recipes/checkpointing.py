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

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import yaml

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
RANK_FILE_PATTERN = re.compile(r"(?:rank_|random_states_)(\d+)")
MANIFEST = "manifest.json"
LATEST = "latest"
RESOLVED_CONFIG = "config.yaml"
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


def sha256_of(path: Path, chunk_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


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
    """Why `directory` is not a complete checkpoint (empty list: it is). Checks presence and sizes;
    `verify_checksums` re-hashes the files for a full check."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return [f"{directory} has no {MANIFEST}: the save that wrote it did not finish"]
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        return [f"{manifest_path} is not valid JSON ({error})"]
    problems = []
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path} is listed in the manifest but missing")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(f"{path} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}")
    return problems


def verify_checksums(directory: Path) -> list[str]:
    manifest = json.loads((directory / MANIFEST).read_text())
    return [
        f"{directory / name}: sha256 differs from the manifest"
        for name, entry in manifest["files"].items()
        if sha256_of(directory / name) != entry["sha256"]
    ]


def has_universal(directory: Path) -> bool:
    """The checkpoint holds DeepSpeed's universal conversion (`universal/pytorch_model/zero/`)."""
    return (Path(directory) / UNIVERSAL_DIR / "pytorch_model" / "zero").is_dir()


def read_manifest(directory: Path) -> dict[str, Any]:
    return json.loads((Path(directory) / MANIFEST).read_text())


def find_resume_checkpoint(output_dir: str | Path, resume: str) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from and notes on what was passed over.

    `resume` is "auto" (newest complete checkpoint in output_dir, none is fine), "none", or a path
    (which must be a complete checkpoint)."""
    if resume == "none":
        return None, []
    if resume != "auto":
        path = Path(resume)
        problems = manifest_problems(path) if path.is_dir() else [f"{path} does not exist"]
        if problems:
            raise CheckpointError("cannot resume from the requested checkpoint: " + "; ".join(problems))
        return path, []
    notes = []
    for path in reversed(checkpoint_dirs(output_dir)):
        problems = manifest_problems(path)
        if not problems:
            return path, notes
        notes.append(f"skipped {path.name}: {problems[0]}")
    return None, notes


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


def write_resolved_config(directory: Path, config_dict: dict[str, Any]) -> None:
    (directory / RESOLVED_CONFIG).write_text(yaml.safe_dump(config_dict, sort_keys=False))


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def save_checkpoint(accelerator, output_dir: str | Path, step: int, state: dict[str, Any], config_dict) -> Path:
    """Write and publish `checkpoint-{step}`; see the module docstring for the order of events."""
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    staging = output_dir / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process and staging.exists():
        shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    failure = ""
    try:
        accelerator.save_state(str(staging))  # collective: each rank writes its own ZeRO-3 shards
        if accelerator.is_main_process:
            write_resolved_config(staging, config_dict)
            (staging / "trainer_state.json").write_text(json.dumps({"global_step": step, **state}, indent=2))
    except (OSError, RuntimeError) as error:  # ENOSPC, EFBIG, EIO; torch.save reports them as RuntimeError
        failure = f"{type(error).__name__}: {error}"
    failed_ranks = _ranks_where(accelerator, bool(failure))
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
    # Each rank hashes the shards it wrote, in parallel: at 70B each holds ~120 GB of the ~1 TB.
    from accelerate.utils import gather_object

    mine = {
        str(path.relative_to(staging)): {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
        for path in owned_files(staging, accelerator.process_index, accelerator.num_processes)
    }
    files: dict[str, Any] = {}
    for part in gather_object([mine]):
        files.update(part)
    if accelerator.is_main_process:
        manifest = {
            "step": step,
            "world_size": accelerator.num_processes,
            "data_position": state.get("data_position"),
            "files": dict(sorted(files.items())),
        }
        _atomic_write_text(staging / MANIFEST, json.dumps(manifest, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        _atomic_write_text(output_dir / LATEST, final.name + "\n")
    accelerator.wait_for_everyone()
    return final


def _ranks_where(accelerator, condition: bool) -> list[int]:
    """The ranks on which `condition` holds (a collective)."""
    import torch

    flags = torch.zeros(accelerator.num_processes, device=accelerator.device)
    flags[accelerator.process_index] = float(condition)
    flags = accelerator.reduce(flags, reduction="sum")
    return [rank for rank in range(accelerator.num_processes) if flags[rank] > 0]


def rotate_checkpoints(accelerator, output_dir: str | Path, save_total_limit: int | None, best: Path | None):
    """Delete the oldest complete checkpoints beyond the limit; incomplete leftovers of killed saves too."""
    output_dir = Path(output_dir)
    doomed: list[Path] = []
    # Only the main process scans: another rank listing the directory while it is being deleted
    # would trip over vanishing files.
    if accelerator.is_main_process:
        complete = [p for p in checkpoint_dirs(output_dir) if not manifest_problems(p)]
        doomed = checkpoints_to_delete(complete, save_total_limit, best)
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        newest = complete[-1] if complete else None
        for leftover in output_dir.glob(".checkpoint-*.tmp"):
            if newest is None or leftover.name != f".{newest.name}.tmp":
                shutil.rmtree(leftover, ignore_errors=True)
    accelerator.wait_for_everyone()
    return doomed


def export_final(accelerator, model, tokenizer, output_dir: str | Path, config_dict) -> Path:
    """Consolidated 16-bit HF weights (safetensors), tokenizer and recipe in `output_dir/final`."""
    final = Path(output_dir) / "final"
    state_dict = accelerator.get_state_dict(model)  # collective: gathers every ZeRO-3 partition
    if accelerator.is_main_process:
        final.mkdir(parents=True, exist_ok=True)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.config.use_cache = True
        unwrapped.save_pretrained(final, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(final)
        write_resolved_config(final, config_dict)
    accelerator.wait_for_everyone()
    return final

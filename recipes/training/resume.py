"""Which checkpoint a launch resumes from, and whether it may: a checkpoint is loaded only when its files match
their checksums and it was saved by a run with the same definition as this launch.

The run-defining values (RUN_DEFINING) are kept in every checkpoint's run_identity.json and compared before the
model is built. Everything else in the recipe may change on a resume (see the README's list)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from common.collectives import from_main_process, main_process_view
from common.files import fingerprint, sha256_of, unused_name
from data_prep.packing.format import MANIFEST as DATA_MANIFEST
from data_prep.packing.format import is_preprocessed, tokenizer_identity
from recipes.config import MODEL_CONFIG_KEYS, PretrainConfig, config_from_dict
from recipes.training import checkpointing, universal
from recipes.training.checkpointing import CheckpointError
from recipes.training.train_data import TrainData

logger = logging.getLogger("pretrain")

RUN_IDENTITY = "run_identity.json"
# What a checkpoint's numbers mean: change any of these and the saved weights, optimizer state or data
# position belong to another run.
RUN_DEFINING = {
    "model_shape": "model_config / model_name_or_path (the model's shape)",
    "max_seq_length": "the tokens per row",
    "global_batch_rows": "the global batch (per_device_train_batch_size x gradient_accumulation_steps x processes)",
    "tokenizer_sha256": "tokenizer_name_or_path (the tokenizer's content)",
    "train_data": "train_files / train_mixture (the data's identity)",
    "text_field": "text_field",
    "train_order": "shuffle_train_rows / data_seed, or seed when data_seed is null (the order of the rows)",
    # what the model computes and is evaluated with: the early-stopping best compared losses of two attention rules,
    # and bf16 -> fp16 took over bf16's static loss scale of 1 (no dynamic scaling)
    "document_masking": "document_masking (what a token attends to, and its positions)",
    "precision": "bf16 / fp16 (the training precision, and its loss scaling)",
}
# What checkpoints from before the order was recorded trained in (and raw text always is)
CORPUS_ORDER = {"shuffled": False}


def data_identity(train_files: list[str]) -> list[dict[str, Any]]:
    """A preprocessed directory by its manifest's hash; raw files by name, size and a sampled hash
    (common.files.fingerprint: 128 KiB read per file; hashing terabytes of raw text at every start would cost hours),
    so a file re-shuffled under its name is another input; hub datasets by name. Moving the data to another path
    keeps its identity."""
    if len(train_files) == 1 and is_preprocessed(train_files[0]):
        return [{"preprocessed_manifest_sha256": sha256_of(Path(train_files[0]) / DATA_MANIFEST)}]
    from data_prep.reading.readers import resolve_sources

    identity = []
    for source in resolve_sources(train_files, "train_files"):
        path = Path(source)
        identity.append({"name": path.name, **fingerprint(path)} if path.is_file() else {"name": source})
    return identity


def _comparable(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """`current` as a checkpoint of an older version recorded it: raw files without their sampled hash, when the
    checkpoint's entries have none (it cannot be compared; name and size still are)."""
    before, now = saved.get("train_data"), current.get("train_data")
    if not isinstance(before, list) or not isinstance(now, list):
        return current
    if any("sample_sha256" in entry for entry in before if isinstance(entry, dict)):
        return current
    return {**current, "train_data": [{k: v for k, v in entry.items() if k != "sample_sha256"} for entry in now]}


def mixture_identity(config: PretrainConfig) -> list[dict[str, Any]]:
    """Each source by its manifest's hash and weight, and what happens when one runs out."""
    return [
        {**data_identity([entry["path"]])[0], "weight": entry["weight"], "exhausted": config.mixture_exhausted}
        for entry in config.train_mixture
    ]


def run_identity(config: PretrainConfig, model_config, tokenizer, world_size: int) -> dict[str, Any]:
    return {
        "model_shape": {key: getattr(model_config, key, None) for key in (*MODEL_CONFIG_KEYS, "rope_parameters")},
        "max_seq_length": config.max_seq_length,
        "global_batch_rows": config.resolved_global_batch_size(world_size),
        "tokenizer_sha256": tokenizer_identity(tokenizer, config.tokenizer_name_or_path)["sha256"],
        "train_data": data_identity(config.train_files) if config.train_mixture is None else mixture_identity(config),
        "text_field": config.text_field,
        "train_order": train_order(config),
        "document_masking": config.document_masking,
        "precision": "bf16" if config.bf16 else "fp16" if config.fp16 else "fp32",
    }


def train_order(config: PretrainConfig) -> dict[str, Any]:
    """How the rows are ordered: shuffled with its seed (preprocessed data), or corpus order."""
    preprocessed = config.train_mixture is not None or (
        len(config.train_files or []) == 1 and is_preprocessed(config.train_files[0])
    )
    if preprocessed and config.shuffle_train_rows:
        return {"shuffled": True, "data_seed": config.resolved_data_seed}
    return CORPUS_ORDER


def run_files(config: PretrainConfig, identity: dict[str, Any]) -> dict[str, str]:
    """The files every checkpoint of this run carries besides its state: the resolved recipe and the identity."""
    return {
        checkpointing.RESOLVED_CONFIG: checkpointing.resolved_config_text(config.to_dict()),
        RUN_IDENTITY: json.dumps(identity, indent=2),
    }


def saved_identity(path: Path, tokenizer) -> dict[str, Any]:
    """The identity a checkpoint was saved with. Checkpoints from before run_identity.json existed get it rebuilt
    from their config.yaml (the tokenizer's content could not be recorded then: this launch's stands in)."""
    if (path / RUN_IDENTITY).is_file():
        return json.loads((path / RUN_IDENTITY).read_text())
    from recipes.training.model import llama_config

    saved = config_from_dict(yaml.safe_load((path / checkpointing.RESOLVED_CONFIG).read_text()), str(path))
    world = checkpointing.read_manifest(path)["world_size"]
    return {**run_identity(saved, llama_config(saved, len(tokenizer)), tokenizer, world), "train_order": CORPUS_ORDER}


def identity_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each differing value, named (`model_shape.num_hidden_layers: 4 -> 2`). Mixture weights are compared as the
    shares they blend to ([7, 3] is [0.7, 0.3]), and a mixture is shown whole."""
    saved = {"train_order": CORPUS_ORDER, **saved}  # checkpoints from before the order was recorded
    current = {"train_order": CORPUS_ORDER, **current}
    saved, current = as_shares(saved), as_shares(_comparable(saved, current))
    changes = []
    for key, meaning in RUN_DEFINING.items():
        if key not in saved or saved[key] == current[key]:
            continue
        if isinstance(saved[key], dict) and isinstance(current[key], dict):
            for inner in sorted(set(saved[key]) | set(current[key])):
                before, after = saved[key].get(inner), current[key].get(inner)
                if before != after:
                    changes.append(f"{key}.{inner}: {_short(before)} -> {_short(after)} ({meaning})")
        else:
            limit = None if key == "train_data" else 80
            changes.append(f"{key}: {_short(saved[key], limit)} -> {_short(current[key], limit)} ({meaning})")
    return changes


LAUNCH_KEYS = ("resume_from_checkpoint", "overwrite_output_dir")  # how this launch starts, not what the run is


def changes_line(checkpoint: Path, current: dict[str, Any]) -> tuple[int, str]:
    """(log level, line) saying what of the recipe differs from `checkpoint`'s: a warning when anything does."""
    try:
        saved = checkpointing.read_config(checkpoint)
    except (OSError, yaml.YAMLError):  # a checkpoint that predates its recipe copy: nothing to compare
        return logging.INFO, f"resume: {checkpoint.name} holds no recipe to compare with"
    changed = config_changes({k: v for k, v in (saved or {}).items() if k not in LAUNCH_KEYS},
                             {k: v for k, v in current.items() if k not in LAUNCH_KEYS})  # fmt: skip
    level = logging.WARNING if changed else logging.INFO
    return level, f"resume: recipe changed since {checkpoint.name}: {'; '.join(changed) or 'nothing'}"


def config_changes(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Each recipe key whose value differs from the checkpoint's resolved recipe (`learning_rate: 0.0001 -> 8e-05`),
    nested keys dotted: what a resume applies of an edited recipe or a forgotten flag, said at its start."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        before, after = saved.get(key), current.get(key)
        if isinstance(before, dict) and isinstance(after, dict):
            changes += config_changes(before, after, f"{prefix}{key}.")
        elif before != after:
            changes.append(f"{prefix}{key}: {_short(before)} -> {_short(after)}")
    return changes


def as_shares(identity: dict[str, Any]) -> dict[str, Any]:
    """`identity` with a mixture's weights replaced by their exact shares (`"7/10"`); other values as they are."""
    sources = identity.get("train_data")
    if not isinstance(sources, list) or not sources or not all("weight" in source for source in sources):
        return identity
    from data_prep.parts.mixture import exact_weights

    shares = exact_weights([float(source["weight"]) for source in sources])
    return {**identity, "train_data": [{**source, "weight": str(share)} for source, share in
                                       zip(sources, shares, strict=True)]}  # fmt: skip


def _short(value: Any, limit: int | None = 80) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def choose_checkpoint(config: PretrainConfig, accelerator) -> Path | None:
    """The newest checkpoint whose files all match their sha256 (every rank hashes its share; a collective);
    a damaged one is skipped for the previous one with a warning (and set aside once an older one verifies), and an
    explicit `--resume PATH` is refused."""
    damaged: list[Path] = []

    def verify(path: Path) -> list[str]:
        started = time.perf_counter()
        problems = checkpointing.verify_on_every_rank(accelerator, path)
        size_gb = sum(entry["bytes"] for entry in checkpointing.read_manifest(path)["files"].values()) / 1e9
        logger.info("resume: verified %s (%.2f GB) in %.1f s", path.name, size_gb, time.perf_counter() - started)
        damaged.extend([path] if problems else [])
        return problems

    # every rank goes by the main process's view of output_dir (a lagging node's differs)
    resume = main_process_view(lambda: resume_request(config))
    path, notes = checkpointing.find_resume_checkpoint(config.output_dir, resume, verify, from_main_process)
    for note in notes:
        logger.warning("resume: %s", note)
    if path is not None and damaged and accelerator.is_main_process:
        for directory in damaged:
            set_aside(directory)
    accelerator.wait_for_everyone()
    if path is None:
        logger.info("resume: starting from scratch (resume_from_checkpoint=%s)", config.resume_from_checkpoint)
    return path


def set_aside(checkpoint: Path) -> Path:
    """Rename a checkpoint whose files differ from their checksums out of the `checkpoint-N` pattern: kept as a
    complete checkpoint, rotation would count it among the ones it keeps (and delete a good one), and a `--resume` of
    an older one would be refused for it. Never deleted: someone may be able to restore it."""
    aside = unused_name(checkpoint.with_name(f"{checkpoint.name}.damaged"))
    os.replace(checkpoint, aside)
    logger.warning("resume: set %s aside as %s (its files differ from their sha256); delete it once it is not needed",
                   checkpoint.name, aside.name)  # fmt: skip
    return aside


def resume_request(config: PretrainConfig) -> str:
    """`resume_from_checkpoint`, unless it names a checkpoint older than one output_dir already holds: refused, or,
    when that newer checkpoint was saved by this very Slurm job (a requeue repeats the job's arguments, its --resume
    too), "auto" with a warning."""
    requested = config.resume_from_checkpoint
    if requested in ("auto", "none"):
        return requested
    newer = checkpointing.newer_than_requested(config.output_dir, Path(requested))
    if newer is None:
        return requested
    job = os.environ.get("SLURM_JOB_ID")
    if job and checkpointing.read_manifest(newer).get("slurm_job_id") == job:
        logger.warning("resume: this job (Slurm job %s) started from %s and has saved %s since; its requeue continues "
                       "from that (a requeue repeats the job's --resume)", job, requested, newer.name)  # fmt: skip
        return "auto"
    if not Path(requested).is_dir():
        return requested  # a path that is not there: said where it is loaded
    raise checkpointing.CheckpointError(
        f"--resume {requested}: {config.output_dir} holds {newer.name}, a later step; continuing from the older one "
        "would mix two runs (rotation keeps the later steps, and --resume auto picks them). Resume with --resume auto, "
        "or, to go back, move the later checkpoints out of output_dir first"
    )


def verify_universal(path: Path, accelerator) -> list[str]:
    """`path`'s universal/ files against the conversion's sha256: every rank hashes its share (a collective)."""
    started = time.perf_counter()
    problems = checkpointing.verify_on_every_rank(accelerator, path, universal.verify_universal_share)
    seconds = time.perf_counter() - started
    logger.info("resume: verified %s/%s in %.1f s", path.name, checkpointing.UNIVERSAL_DIR, seconds)
    return problems


def check_resumable(path: Path, identity: dict[str, Any], tokenizer, data: TrainData, world_size: int,
                    convert: Callable[[Path], None] | None = None,
                    verify_universal: Callable[[Path], list[str]] | None = None) -> None:  # fmt: skip
    """Refuse, before the model is built, a checkpoint saved by another run or that this launch cannot continue. A
    checkpoint of another world size is converted with `convert` (elastic runs) once every other check has passed;
    without it, its universal/ is checked with `verify_universal` (a collective re-hash)."""
    saved = saved_identity(path, tokenizer)
    changes = identity_changes(saved, identity)
    if changes:
        raise CheckpointError(
            f"cannot resume from {path}: the run-defining values differ from the checkpoint's: "
            + "; ".join(changes)
            + ". Resume with the values it was saved with, or start a new run in another output_dir"
        )
    saved_world = checkpointing.read_manifest(path)["world_size"]
    problem = data.resume_problem(checkpointing.read_trainer_state(path)["data_position"])
    if problem:
        raise CheckpointError(f"cannot resume from {path}: {problem}")
    if saved_world != world_size:
        if convert is not None:
            convert(path)  # a no-op when a loadable universal/ is there
        # the main process's view: `verify_universal` below is a collective, and a lagging node's view may differ
        present, damaged = main_process_view(lambda: universal.presence(path))
        if present and not damaged and convert is None and verify_universal is not None:
            damaged = verify_universal(path)  # (`convert` re-hashed it already)
        if damaged:
            raise CheckpointError(
                f"cannot resume from {path}: its universal/ cannot be loaded: {damaged[0]}"
                + (f" (and {len(damaged) - 1} more)" if damaged[1:] else "")
                + ". Convert it again (move universal/ aside first), or set elastic: true to have the run do it"
            )
        if not present:
            raise CheckpointError(
                f"{path} was written by {saved_world} processes, this launch has {world_size}. ZeRO-3 shards are "
                "per rank: set elastic: true (with global_batch_size) to convert it at start, or convert it once "
                f"with DeepSpeed's universal format into a staging folder and move it into place when it has "
                f"finished: python -m deepspeed.checkpoint.ds_to_universal --input_folder {path}/pytorch_model "
                f"--output_folder {path}/.universal.manual/pytorch_model && mv {path}/.universal.manual "
                f"{path}/{checkpointing.UNIVERSAL_DIR} , then relaunch"
            )
        logger.warning(
            "resume: %s was written by %d processes; loading its universal checkpoint on %d. Per-rank RNG states "
            "do not carry over (reseeded from seed + step), so the run continues exactly but not bit-identically",
            path,
            saved_world,
            world_size,
        )


def steps_problem(total_steps: int, path: Path) -> str | None:
    """A run asked to stop before the step its checkpoint already reached: it used to be ignored silently (and the
    lower value written into config.yaml). Equal is a finished run relaunched: it exports again, as before."""
    reached = checkpointing.read_trainer_state(path)["run_state"]["step"]
    if total_steps >= reached:
        return None
    return (
        f"max_steps / total_tokens give {total_steps} steps, but {path.name} is at step {reached}: a run cannot "
        f"stop before where it is. Raise max_steps to continue it, or export {path} as it is with "
        "python -m recipes.export"
    )

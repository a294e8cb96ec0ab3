"""Hugging Face model directories from a run: `final/` at its end, and any complete checkpoint on demand.

    python -m recipes.export CHECKPOINT_DIR --output DIR [--dtype bfloat16] [--max-shard-size 5GB] \
        [--tokenizer DIR] [--overwrite]

A checkpoint holds per-rank ZeRO-3 shards (or, after `ds_to_universal`, one fp32 file per parameter: read when the
rank shards are not all there). The export reads them tensor by tensor through DeepSpeed's lazy consolidation
(`get_fp32_state_dict_from_zero_checkpoint`, optimizer files memory-mapped), so memory holds one output shard rather
than the model: never the ~280 GB fp32 copy of a 70B model (recipes.export_weights). It writes sharded safetensors
with an index, config.json (the shape the run trained with, `architectures`) and generation_config.json with the
tokenizer's bos/eos/pad ids, the tokenizer (the run's own copy, RUN/tokenizer), the resolved recipe and `export.json`
(source step, run and tokenizer), into a staging directory (`.export-NAME.tmp`) that is renamed into place when
complete. `final/` is written by this same function. Every file read is checked against its sha256 (the manifest's,
universal/conversion.json's) first, the checkpoint is pinned against rotation while it is read, and an output that
is, holds or lies inside the run, the checkpoint or the tokenizer is refused, `--overwrite` or not.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from common.exit_codes import BAD_INPUT, DISK_FULL, DONE, OneLineParser, disk_full, disk_full_line, fail
from common.process import peak_rss_bytes

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.files import atomic_write_text, replace_directory, replaced_aside, restore_replaced, sync_tree
from common.lock import FileLock, LockedError
from recipes import export_weights
from recipes.config import ConfigError, PretrainConfig, config_from_dict
from recipes.export_weights import SHARDS, reader_pinned, shape_changes, verified_problems, weights_source
from recipes.training import checkpointing

if TYPE_CHECKING:
    from recipes.training.run_state import Stop, StopSignals
    from recipes.training.startup import Launch
    from recipes.training.trainer import Trainer

logger = logging.getLogger("pretrain")
DTYPES = ("bfloat16", "float16", "float32")


def generation_config_for(model_config):
    """Greedy by default, the tokenizer's special ids, and the KV cache on (training turns it off)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=model_config.bos_token_id,
        eos_token_id=model_config.eos_token_id,
        pad_token_id=model_config.pad_token_id,
        use_cache=True,
    )


def export_checkpoint(
    checkpoint: str | Path,
    output: str | Path,
    *,
    dtype: str = "bfloat16",
    max_shard_size: str = "5GB",
    tokenizer_path: str | None = None,
    overwrite: bool = False,
    verify: bool = True,
    run_may_hold_output: bool = False,
    tokenizer=None,
) -> Path:
    """Write the Hugging Face model directory of a complete `checkpoint-N` to `output`; returns `output`.

    Every file read is first checked against the manifest's sha256 (`verify`; the run's own `final/` skips it: its
    ranks hashed the checkpoint as they saved it). While reading, the export holds the checkpoint's reader pin, so a
    live run's rotation keeps it, and an exclusive lock on `output`, so a second export to it is refused. Nothing is
    published and no staging directory is left when anything fails. `--overwrite` never removes what the export
    reads: an output that is, holds or lies inside the run directory (`run_may_hold_output`: the run's `final/`),
    the checkpoint or the tokenizer is refused. A tokenizer read from disk must be the one the run trained with (its
    content hash, recorded in every checkpoint); the live run passes the `tokenizer` it loaded at its start."""
    checkpoint, output = Path(checkpoint), Path(output)
    if (checkpoint / "export.json").is_file() and (checkpoint / "config.json").is_file():
        raise ConfigError(f"{checkpoint} is an exported model directory already (export.json): use it as it is")
    source, problems = weights_source(checkpoint)  # the rank shards, or universal/ when they are not all there
    if problems:
        raise ConfigError(f"cannot export {checkpoint}: {problems[0]}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    config = config_from_dict(checkpointing.read_config(checkpoint), str(checkpoint / checkpointing.RESOLVED_CONFIG))
    kept = checkpoint.parent / checkpointing.TOKENIZER_COPY  # the run's own copy (none before it kept one)
    tokenizer_dir = Path(tokenizer_path or (kept if kept.is_dir() else config.tokenizer_name_or_path))
    reads = {"the checkpoint": checkpoint, "the tokenizer": tokenizer_dir}
    if not run_may_hold_output:
        reads["the run directory"] = checkpoint.parent
    check_output(output, overwrite, reads)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)  # `--output /models/step-4000` on a fresh volume
        with FileLock(checkpointing.export_staging(output)[1], what="another export to this --output"), \
                reader_pinned(checkpoint):  # fmt: skip
            if verify:
                bad = verified_problems(checkpoint, source)
                if bad:
                    raise ConfigError(f"cannot export {checkpoint}: {bad[0]}" + (f" (and {len(bad) - 1} more)"
                                                                                 if bad[1:] else ""))  # fmt: skip
            return _export(checkpoint, output, config, dtype, max_shard_size, tokenizer_dir, tokenizer, source)
    except LockedError as error:
        raise ConfigError(f"--output {output}: {error}; wait for it to end or choose another --output") from None
    except OSError as error:  # e.g. a file deleted while read by a process that does not honour the pin
        raise ConfigError(
            f"cannot export {checkpoint}: {error.filename or error} ({error.strerror or error})"
        ) from None


def check_output(output: Path, overwrite: bool, reads: dict[str, Path]) -> None:
    """`output` must not exist (or `overwrite`), and must not be, hold or lie inside anything the export reads. A new
    directory inside the run directory is fine (an export beside its checkpoints); replacing one there is not."""
    if output.is_symlink() and not output.exists():  # found now, not after the whole model has been written
        raise ConfigError(f"--output {output} is a symbolic link to {os.readlink(output)}, which does not exist: "
                          "remove the link, or give the directory it should point to")  # fmt: skip
    target = output.resolve()
    for what, path in reads.items():
        source = path.resolve()
        inside = target.is_relative_to(source) and target != source
        if inside and what == "the run directory" and not (overwrite and output.exists()):
            continue
        if target == source or source.is_relative_to(target) or inside:
            relation = "is" if target == source else "lies inside" if inside else "holds"
            raise ConfigError(f"--output {output} {relation} {what} ({path}): choose a directory apart from it")
    if output.exists() and not overwrite:
        raise ConfigError(f"--output {output} exists; choose a new directory or pass --overwrite")


def _recorded_tokenizer_sha256(checkpoint: Path) -> str | None:
    """The tokenizer content hash the checkpoint's run identity records (None before identities were recorded)."""
    from recipes.training.resume import RUN_IDENTITY

    path = checkpoint / RUN_IDENTITY
    return json.loads(path.read_text()).get("tokenizer_sha256") if path.is_file() else None


def _the_runs_tokenizer(checkpoint: Path, tokenizer_dir: Path):
    """The tokenizer in `tokenizer_dir`, refused when it is not the one the run trained with (a tokenizer trained
    again into the same directory would pair another vocabulary with the embeddings)."""
    from data_prep.packing.format import tokenizer_identity
    from data_prep.tokenizer.loading import TokenizerLoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer(str(tokenizer_dir), "the run's tokenizer (--tokenizer)")
    except TokenizerLoadError as error:
        raise ConfigError(str(error)) from None
    recorded, found = _recorded_tokenizer_sha256(checkpoint), tokenizer_identity(tokenizer, tokenizer_dir)["sha256"]
    if recorded and recorded != found:
        raise ConfigError(
            f"tokenizer {tokenizer_dir} is not the one {checkpoint.name} was trained with (content sha256 "
            f"{found[:12]}, {len(tokenizer):,} tokens; the run's: {recorded[:12]}): it was replaced since. Pass "
            "--tokenizer with the run's own (its final/ or an earlier export carries it)"
        )
    return tokenizer


def _warn_if_replaced(checkpoint: Path, tokenizer, tokenizer_dir: Path) -> None:
    """The live run exports the tokenizer it trained with; a directory that now holds another one is said."""
    from data_prep.packing.format import tokenizer_identity
    from data_prep.tokenizer.loading import TokenizerLoadError, load_tokenizer

    try:
        on_disk = tokenizer_identity(load_tokenizer(str(tokenizer_dir), "tokenizer_name_or_path"), tokenizer_dir)
    except TokenizerLoadError:
        on_disk = None
    if on_disk is None or on_disk["sha256"] != tokenizer_identity(tokenizer, tokenizer_dir)["sha256"]:
        logger.warning(
            "tokenizer_name_or_path %s no longer holds the tokenizer this run trained with (it was replaced or "
            "removed while the run went on): final/ carries the run's own, loaded at its start; a resume from %s "
            "will refuse the directory as it is", tokenizer_dir, checkpoint.name,
        )  # fmt: skip


def _export(checkpoint: Path, output: Path, config: PretrainConfig, dtype: str, max_shard_size: str,
            tokenizer_dir: Path, tokenizer=None, source: str = SHARDS) -> Path:  # fmt: skip
    """The export itself, under the output's lock and the checkpoint's pin; `source`: the form of the weights read
    (`weights_source`)."""
    from recipes.training.output_dir import export_stagings

    tokenizer_source = "the live run's" if tokenizer is not None else str(tokenizer_dir.resolve())
    if tokenizer is None:
        tokenizer = _the_runs_tokenizer(checkpoint, tokenizer_dir)
    else:
        _warn_if_replaced(checkpoint, tokenizer, tokenizer_dir)
    model_config = _model_config(checkpoint, config, tokenizer)
    staging = checkpointing.export_staging(output)[0]
    for stale in export_stagings(output):  # this process holds the lock: whoever wrote it is gone
        logger.warning("removing %s, left by an export to %s that was killed", stale, output)
        shutil.rmtree(stale, ignore_errors=True)
    if replaced_aside(output).is_dir():  # killed between replace_directory's renames: the old output, whole
        path, _, restored = restore_replaced(replaced_aside(output))
        logger.warning("%s %s, left by an export to %s that was killed", "put back" if restored else "removed", path,
                       output)  # fmt: skip
    staging.mkdir(parents=True)
    try:
        _write_weights(checkpoint, staging, dtype, max_shard_size, model_config, source)
        model_config.dtype = dtype
        model_config.use_cache = True
        model_config.save_pretrained(staging)
        generation_config_for(model_config).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        checkpointing.write_resolved_config(staging, config.to_dict())
        record = {
            "checkpoint": str(checkpoint.resolve()),
            "step": checkpointing.read_manifest(checkpoint)["step"],
            "run": str(checkpoint.resolve().parent),
            "dtype": dtype,
            "weights_from": source,
            "tokenizer": tokenizer_source,
            "exported": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        atomic_write_text(staging / "export.json", json.dumps(record, indent=2))
        with_umask_modes(staging)
        sync_tree(staging, files=True)  # on storage before it takes the name an evaluation or a copy trusts
        replace_directory(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when published
    return output


def _model_config(checkpoint: Path, config: PretrainConfig, tokenizer):
    """The exported config.json: the model's shape as the run trained with it (refused when the directory of
    model_name_or_path was edited since), the tokenizer's special ids, and the class to load it with (vLLM and TGI
    read `architectures`)."""
    from recipes.training.model import llama_config, with_token_ids

    model_config = with_token_ids(llama_config(config, len(tokenizer)), tokenizer)
    changed = shape_changes(checkpoint, model_config)
    if changed:
        built_from = f"model_name_or_path {config.model_name_or_path}" if config.model_name_or_path else "its recipe"
        raise ConfigError(f"cannot export {checkpoint}: the model config built from {built_from} is not the one the "
                          f"run trained with (run_identity.json model_shape): {'; '.join(changed)}. Put back the "
                          "config.json the run trained with")  # fmt: skip
    model_config.architectures = [export_weights.causal_lm_class(model_config).__name__]
    return model_config


def with_umask_modes(directory: Path) -> None:
    """Give every file and directory under `directory` the mode the process's umask gives a new one (0644 and 0755
    under the usual 022), keeping a directory's setgid bit (group inheritance on shared storage): DeepSpeed's
    conversion writes the weights 0600, which a teammate on shared storage cannot read."""
    umask = process_umask()
    for path in [directory, *directory.rglob("*")]:
        setgid = path.stat().st_mode & stat.S_ISGID if path.is_dir() else 0
        path.chmod(((0o777 if path.is_dir() else 0o666) & ~umask) | setgid)


def process_umask() -> int:
    """This process's umask, read without setting it (os.umask would change it for every thread meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    probe = Path(tempfile.mkdtemp()) / "probe"  # elsewhere: the mode a new file gets
    try:
        probe.touch(mode=0o666)
        return 0o666 & ~probe.stat().st_mode & 0o777
    finally:
        shutil.rmtree(probe.parent, ignore_errors=True)


_write_weights = export_weights.write_weights  # by this name, so that a test can fail it half way


class ExportInterrupted(BaseException):
    """A stop signal during the final export: the checkpoint is complete, final/ is not written (a relaunch of the
    same command exports it); the rank exits 0 as for any stop signal. A BaseException, as KeyboardInterrupt is, so
    that no library's `except Exception` on the way swallows it."""


@contextmanager
def _abandoned_on_stop_signal(signals: StopSignals, source: Path, output: Path) -> Iterator[None]:
    """Slurm's preemption gives a job KillWait (30 s by default) between SIGTERM and SIGKILL, less than a 70B export
    takes (~140 GB): a signal before or during the export abandons it at once (its staging is removed on the way
    out) instead of being killed halfway, and the run exits as a stopped run, 0."""
    # not `python -m recipes.export`: it refuses to replace an output inside the run directory (`check_output`)
    advice = (
        f"{source.name} is saved and complete; {output.name}/ was not written: relaunch the same command to export it"
    )

    def interrupt(signum, frame):
        raise ExportInterrupted(f"stop signal ({signal.Signals(signum).name}) during the final export: {advice}")

    if signals.received is not None:
        raise ExportInterrupted(f"stop signal ({signal.Signals(signals.received).name}) before the final export: "
                                f"{advice}")  # fmt: skip
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def export_run(config: PretrainConfig, launch: Launch, trainer: Trainer, stop: Stop) -> None:
    """`final/` from the best checkpoint after early stopping, else from this step's (saved now if it is not
    yet), then the run's record (`record_run`). The main process writes; the other ranks are done."""
    from recipes.training.run_state import StopReason

    state, run_dir = trainer.state, Path(config.output_dir)
    source = trainer.save()  # a collective; returns the newest checkpoint when this step is saved already
    if stop.reason is StopReason.EARLY_STOPPING and state.best_checkpoint:
        best = run_dir / state.best_checkpoint
        # saved by an earlier launch, maybe weeks ago, and never re-read since: re-hashed (a collective) unless this
        # launch saved or loaded it. Damage of the same size gave a final/ of wrong weights and no error.
        problems = trainer.checkpointer.verify(best)
        if problems:
            logger.warning("the best checkpoint, %s, cannot be exported (%s): exporting this step's, %s, instead",
                           best.name, problems[0], source.name)  # fmt: skip
        else:
            source = best
            logger.info("exporting the best checkpoint, %s, to final/", state.best_checkpoint)
    peaks_by_host = _host_peaks()  # a collective
    if not trainer.accelerator.is_main_process:
        return
    dtype = "bfloat16" if config.bf16 else "float16" if config.fp16 else "float32"
    with _abandoned_on_stop_signal(trainer.signals, source, run_dir / "final"):
        # hashed by this launch (saved, loaded or verified above): no second read of ~830 GB at 70B before final/
        final_dir = export_checkpoint(source, run_dir / "final", dtype=dtype, overwrite=True, verify=False,
                                      run_may_hold_output=True, tokenizer=launch.inputs.tokenizer,
                                      tokenizer_path=config.tokenizer_name_or_path)  # fmt: skip
    _write_record(config, launch, trainer, stop, peaks_by_host, source.name, final_dir)


def record_run(config: PretrainConfig, launch: Launch, trainer: Trainer, stop: Stop) -> None:
    """A run stopped by a signal, saved and to be continued: its run_summary.json, report.md and loss.png as of the
    checkpoint it saved, without final/ (a collective; the main process writes)."""
    peaks_by_host = _host_peaks()
    if trainer.accelerator.is_main_process:
        _write_record(config, launch, trainer, stop, peaks_by_host, None, None)


def _host_peaks() -> list[tuple[str, float]]:
    """(host, peak resident GB) of every rank (a collective)."""
    from accelerate.utils import gather_object

    from recipes.telemetry.metrics import peak_host_memory_gb

    return gather_object([(socket.gethostname(), peak_host_memory_gb())])


def _write_record(config: PretrainConfig, launch: Launch, trainer: Trainer, stop: Stop,
                  peaks_by_host: list[tuple[str, float]], exported_from: str | None,
                  final_dir: Path | None) -> None:  # fmt: skip
    """run_summary.json, and report.md and loss.png drawn from it and metrics.jsonl: one record of the run."""
    from recipes.telemetry.metrics import plan_vs_measured, read_metrics, write_run_outputs

    state, run_dir = trainer.state, Path(config.output_dir)
    per_host: dict[str, float] = {}
    for host, peak in peaks_by_host:
        per_host[host] = per_host.get(host, 0.0) + peak
    measured = plan_vs_measured(launch.inputs.predictions, read_metrics(run_dir / "metrics.jsonl"), per_host)
    summary = dict(
        steps=state.step, num_tokens=state.num_tokens, stop_reason=str(stop), launches=state.launches,
        wall_seconds=trainer.wall_seconds(), best_eval_loss=state.best_eval_loss,
        best_checkpoint=state.best_checkpoint, resumed_from=str(launch.resume_from) if launch.resume_from else None,
        exported_from=exported_from, num_parameters=trainer.num_parameters,
        world_size=trainer.accelerator.num_processes, peak_host_memory_gb_per_rank=[peak for _, peak in peaks_by_host],
        attn_implementation=launch.inputs.attn_implementation,
        tokens_per_s=next(row["measured"] for row in measured if row["quantity"] == "tokens_per_s"),
        plan_vs_measured=measured,
    )  # fmt: skip
    write_run_outputs(run_dir, final_dir, summary)


def main(argv: list[str] | None = None) -> int:
    """Exit codes (docs/run-safety.md): 0 exported; 2 bad input, one line; 4 the output's disk is full (make room,
    then the same command exports again: nothing half-written is published)."""
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a complete checkpoint-N directory of a run")
    parser.add_argument("--output", required=True, help="the model directory to write (refused if it exists)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weights' dtype (default bfloat16)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the run's own copy, RUN/tokenizer, or for "
                        "runs that kept none, its recorded path); refused unless the run trained with it")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    args = parser.parse_args(argv)
    try:
        output = export_checkpoint(args.checkpoint, args.output, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                   tokenizer_path=args.tokenizer, overwrite=args.overwrite)  # fmt: skip
    except Exception as error:  # a full disk comes as a ConfigError, an OSError or safetensors' own error
        full = disk_full(error)
        if full is not None:
            return fail(disk_full_line(args.output, full, "it exports again (nothing was published)"), DISK_FULL)
        if isinstance(error, ConfigError):
            return fail(str(error), BAD_INPUT)
        raise
    peak_mb = peak_rss_bytes() / 2**20
    print(f"exported {args.checkpoint} to {output} (peak memory {peak_mb:.0f} MB)")
    return DONE


if __name__ == "__main__":
    sys.exit(main())

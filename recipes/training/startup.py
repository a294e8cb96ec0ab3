"""Everything before the model costs anything: distributed setup, logging, the preflight checks of every
input, and the choice of the checkpoint to resume from. A bad config, file or checkpoint stops here."""

from __future__ import annotations

import atexit
import logging
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from common.collectives import disagreements, on_every_rank, on_main_process, smallest_on_any_rank
from common.hardware import cpu_has_native_bf16
from common.process import local_world_size
from data_prep.reading.readers import resolve_sources
from data_prep.tokenizer.loading import TokenizerLoadError, load_tokenizer, pin_tokenizer
from eval.harness import BenchmarkSettings
from recipes.config import (
    ConfigError,
    PretrainConfig,
    deepspeed,
    elastic_accumulation,
    validate_against_model,
    validate_for_world,
)
from recipes.planning.hardware import live_hardware
from recipes.planning.plan import make_plan, plan_predictions
from recipes.planning.report import format_plan
from recipes.telemetry.trackers import check_trackers
from recipes.training import attention, checkpointing
from recipes.training.benchmark_checks import benchmark_settings, check_benchmarks
from recipes.training.model import check_leaf_modules, detect_attn_implementation, llama_config
from recipes.training.op_builds import serialize_op_builds
from recipes.training.resume import run_identity
from recipes.training.train_data import open_train_source

logger = logging.getLogger("pretrain")


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_deepspeed_lean() -> None:
    """DeepSpeed, without two imports of modules the recipe never uses, each seconds of every rank's start:
    - its autotuner imports mlflow whenever it is installed (the `trackers` extra): 2.5-3.2 s on the development
      machine, against 0.4-0.6 s without. mlflow is hidden while DeepSpeed imports, and importable again after (the
      MLflow tracker imports it then);
    - ZeRO-3 imports its Muon optimizer when the engine is built, only to ask whether the optimizer is one, and that
      import compiles Muon's kernels: 2.3 s here. The recipe's optimizer is AdamW (DeepSpeed's CPU Adam when
      offloaded), never Muon, so a stand-in module answers that question (nothing is a MuonWithAuxAdam)."""
    import sys
    import types

    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # an import of it raises ImportError, which DeepSpeed takes as "not installed"
    try:
        import deepspeed  # noqa: F401
    finally:
        if sys.modules.get("mlflow") is None:
            del sys.modules["mlflow"]
    if MUON_MODULE not in sys.modules:
        stand_in = types.ModuleType(MUON_MODULE, "the recipe never uses Muon (recipes.training.startup)")
        stand_in.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})
        sys.modules[MUON_MODULE] = stand_in


# A collective that waits this long past the hang watchdog's timeout ends the process without a stack: the watchdog
# (which dumps every thread's stack) and the dataloader's stall timeout (half of it, exit 5) must come first.
# DeepSpeed's own default, 10 minutes, came before both (1800 s and 900 s by default).
COLLECTIVE_TIMEOUT_MARGIN_S = 600
DEEPSPEED_COLLECTIVE_TIMEOUT_S = 600  # deepspeed.constants.default_pg_timeout, without DEEPSPEED_TIMEOUT set


def collective_timeout_s(hang_timeout_s: float | None) -> float:
    """How long a rank waits in a collective before its process group gives up: the watchdog's timeout and a margin,
    or DeepSpeed's own timeout and the margin when the watchdog is off."""
    return (hang_timeout_s or DEEPSPEED_COLLECTIVE_TIMEOUT_S) + COLLECTIVE_TIMEOUT_MARGIN_S


def process_group_timeout_s() -> float | None:
    """The default process group's timeout as its backend holds it (None where the backend does not say)."""
    import torch.distributed as dist

    try:
        backend = dist.group.WORLD._get_backend(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def setup_distributed(config: PretrainConfig):
    """The Accelerator, with the DeepSpeed JSON's recipe-owned values filled from the recipe."""
    import_deepspeed_lean()
    serialize_op_builds()  # before anything loads an op
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    check_gpus_per_node()
    timeout = timedelta(seconds=collective_timeout_s(config.hang_timeout_s))
    if not torch.cuda.is_available():
        # Without CUDA accelerate finds no backend and every rank believes it is rank 0 of 1,
        # while DeepSpeed runs 2: sharding, logging and saving would silently go wrong.
        PartialState(backend="gloo", timeout=timeout)
    ds_path = deepspeed.launched_config_path()
    if ds_path is None:
        raise ConfigError(
            "no DeepSpeed config: launch with `accelerate launch --config_file accelerate_configs/<file>.yaml "
            "recipes/pretrain.py --config ...` (the accelerate config names the ZeRO-3 JSON)"
        )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if config.elastic:  # the global batch is the recipe's on any number of processes; accumulation follows
        config.gradient_accumulation_steps = elastic_accumulation(config, world_size, local_world_size())
    validate_for_world(config, world_size)
    ds_config = deepspeed.resolve_deepspeed_config(deepspeed.load_deepspeed_json(ds_path), config, world_size)
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config, zero3_init_flag=deepspeed.zero3_init_requested())
    from recipes.telemetry.trackers import trackers_for

    accelerator = Accelerator(
        deepspeed_plugin=plugin,
        log_with=trackers_for(config.report_to, config.output_dir) or None,
        mixed_precision="bf16" if config.bf16 else "fp16" if config.fp16 else "no",
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
    )
    if accelerator.num_processes != world_size:
        raise RuntimeError(f"accelerate sees {accelerator.num_processes} processes but WORLD_SIZE is {world_size}")
    return accelerator, ds_config


def check_gpus_per_node() -> None:
    """An accelerate config for 8 GPUs on a machine with fewer starts 8 CPU ranks that fail minutes later, far from
    the cause: say it now. DS_ACCELERATOR=cpu marks a deliberate CPU rehearsal (the tests, the demo)."""
    per_node = local_world_size()
    gpus = torch.cuda.device_count()
    if per_node > gpus and os.environ.get("DS_ACCELERATOR") != "cpu":
        raise ConfigError(
            f"this launch starts {per_node} processes on this node, but it has {gpus} GPU(s) "
            "(torch.cuda.device_count()): use the accelerate config for this many GPUs, or set DS_ACCELERATOR=cpu "
            "for a CPU rehearsal"
        )


def configure_logging(accelerator) -> None:
    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=level, force=True)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # per-task notices; eval.in_loop logs the results
    # DeepSpeed calls torch's deprecated collective names on every step; one warning per call floods the log.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")


@dataclass
class RunInputs:
    """What preflight checked and the rest of the run builds on."""

    tokenizer: object
    model_config: object  # transformers.LlamaConfig
    attn_implementation: str
    train_source: object  # PackedRows, MixedRows, or raw file paths
    validation_rows: torch.Tensor | None  # held-out rows, identical on every rank; None without validation_files
    benchmarks: BenchmarkSettings | None
    identity: dict  # what defines the run: a checkpoint of another run is not resumed (recipes.training.resume)
    predictions: dict  # the plan's step time, tokens/s and peak memory, put beside the measured ones at the end
    tokenizer_pin: object = None  # held while the run lives: train_tokenizer --overwrite refuses this directory


def bf16_emulation_warning(bf16: bool, cuda: bool, native_bf16: bool) -> str | None:
    """The line a CPU run in bf16 gets where the CPU has no bf16 instructions (no AVX512-BF16 or AMX): torch then
    emulates bf16 matmuls, 10-100x slower than fp32 (common.hardware has the measurements)."""
    if not bf16 or cuda or native_bf16:
        return None
    return (
        "bf16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): torch emulates it, "
        "10-100x slower than fp32; --bf16 false trains this rehearsal in fp32"
    )


def preflight(config: PretrainConfig, accelerator, ds_config) -> RunInputs:
    """Everything that can be wrong with the inputs, checked before the model costs anything."""
    try:
        tokenizer = load_tokenizer(config.tokenizer_name_or_path, "tokenizer_name_or_path")
    except TokenizerLoadError as error:
        raise ConfigError(str(error)) from None
    pin = pin_tokenizer(config.tokenizer_name_or_path)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {config.tokenizer_name_or_path} has no EOS token; packing needs one")
    train_source = open_train_source(config, tokenizer, accelerator.num_processes)
    if config.elastic and isinstance(train_source, list):  # found now, not after a node is lost weeks later
        raise ConfigError(
            "elastic: true needs preprocessed train data (python -m data_prep.preprocess): a raw-text position is "
            "per rank and dataloader worker, so it cannot move to another number of processes"
        )
    validation = validation_rows(config, tokenizer)
    model_config = checked_model_config(config, tokenizer)
    benchmarks = check_benchmarks(config, tokenizer, model_config.max_position_embeddings, accelerator)
    slow_bf16 = bf16_emulation_warning(config.bf16, torch.cuda.is_available(), cpu_has_native_bf16())
    if slow_bf16:
        logger.warning(slow_bf16)
    attn_implementation, reason = detect_attn_implementation(config.attn_implementation)
    logger.info("%s (%s)", attention.describe(attn_implementation, config.document_masking), reason)
    plan = make_plan(
        config, live_hardware(config, accelerator.num_processes), ds_config, vocab_size=model_config.vocab_size
    )
    logger.info("preflight %s", format_plan(plan, config))
    if settle_eval_batch(config, plan.eval_batch_fits, accelerator):
        benchmarks = benchmark_settings(config)
    # on every rank together: the plan reads this node's memory, and a node alone refusing left the others waiting
    on_every_rank(lambda: refuse_unfit(plan.fits or not config.preflight_strict, plan.verdicts), catch=(ConfigError,))
    if config.prometheus_port is not None:  # every node's local rank 0 serves it
        port, host = config.prometheus_port, config.metrics_host
        on_every_rank(lambda: accelerator.is_local_main_process and check_port_free(port, host), catch=(ConfigError,))
    if config.report_to and config.report_to != ["none"]:  # the trackers start on the main process, after the model
        report_to = config.report_to
        on_every_rank(lambda: accelerator.is_main_process and check_trackers(report_to), catch=(ConfigError,))
    identity = run_identity(config, model_config, tokenizer, accelerator.num_processes)
    check_ranks_read_alike(identity, validation, attn_implementation)
    return RunInputs(tokenizer, model_config, attn_implementation, train_source, validation, benchmarks, identity,
                     plan_predictions(plan), pin)  # fmt: skip


def checked_model_config(config: PretrainConfig, tokenizer):
    """The model's config, checked against the recipe and the tokenizer, and the leaf classes against the model."""
    model_config = llama_config(config, len(tokenizer))
    validate_against_model(
        config,
        vocab_size=model_config.vocab_size,
        tokenizer_size=len(tokenizer),
        max_positions=model_config.max_position_embeddings,
    )
    check_leaf_modules(config.zero3_leaf_modules, model_config)
    return model_config


def check_ranks_read_alike(identity: dict, validation: torch.Tensor | None, attn_implementation: str) -> None:
    """Each rank reads the tokenizer, the data and the validation files from its own node's file system: a node-local
    copy that differs trained other rows, or gave its ranks another number of validation batches, which hung the
    first evaluation hours in. Refused on every rank before the model (a collective)."""
    import hashlib
    import json

    from recipes.training.validation import rows_sha256

    said = disagreements({
        "run identity (tokenizer, model, data: sha256)": hashlib.sha256(
            json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "validation rows (sha256)": rows_sha256(validation)[:16] if validation is not None else None,
        "attention implementation": attn_implementation,
    })  # fmt: skip
    if said:
        raise ConfigError("the ranks read different inputs (a copy on one node's local disk that differs?): "
                          + "; ".join(said))  # fmt: skip


def refuse_unfit(fits: bool, verdicts: list[str]) -> None:
    if not fits:
        raise ConfigError("the plan says this run does not fit:\n  " + "\n  ".join(verdicts) + "\nChange the recipe "
                          "or DeepSpeed config, or set preflight_strict: false to try anyway.")  # fmt: skip


def settle_eval_batch(config: PretrainConfig, fits: int | None, accelerator) -> bool:
    """The evaluation batch of every rank: what the plan says fits an elastic run's world size, and the smallest any
    node fits (nodes of unlike memory ran different numbers of evaluation forwards: a hang). Whether it changed (a
    collective)."""
    changed = config.elastic and fit_eval_batch(config, fits, accelerator.num_processes)
    smallest = smallest_on_any_rank(config.per_device_eval_batch_size, accelerator.device)
    changed = changed or smallest != config.per_device_eval_batch_size
    config.per_device_eval_batch_size = smallest
    return changed


def fit_eval_batch(config: PretrainConfig, fits: int | None, world_size: int) -> bool:
    """An elastic run on fewer GPUs holds a larger shard of the model in each: its evaluation batch becomes what the
    plan says fits (the 16-GPU recipe's 32 rows are 23 on 8 GPUs). Returns whether it changed."""
    if fits is None or not 0 < fits < config.per_device_eval_batch_size:
        return False
    logger.warning("elastic: per_device_eval_batch_size %d -> %d, what fits on %d processes",
                   config.per_device_eval_batch_size, fits, world_size)  # fmt: skip
    config.per_device_eval_batch_size = fits
    return True


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """The metrics port can be bound here: a busy port fails now, not after a 70B checkpoint is restored."""
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            where = socket.gethostname()
            message = (f"prometheus_port {port} cannot be served on {where} at {host} ({error.strerror}): choose a "
                       "free port, or a metrics_host this machine has")  # fmt: skip
            raise ConfigError(message) from None


def validation_rows(config: PretrainConfig, tokenizer) -> torch.Tensor | None:
    """Held-out rows, identical on every rank (each reads them); None without validation_files. Read in preflight:
    a validation set that yields nothing is a bad input (exit 2), found before the model is built."""
    sources = resolve_sources(config.validation_files, "validation_files")
    if not sources:
        return None
    from recipes.training.validation import load_validation_rows, rows_sha256

    rows = load_validation_rows(sources, tokenizer, config.max_seq_length, config.text_field, config.max_eval_samples)
    logger.info(
        "validation: %d rows of %d tokens (sha256 %s)", len(rows), config.max_seq_length, rows_sha256(rows)[:12]
    )
    return rows


def data_passes(config: PretrainConfig, data, world: int) -> tuple[int, str]:
    """How many steps the data gives against the run's (recipes.training.train_data.passes_line)."""
    from recipes.training.schedule import recipe_lr
    from recipes.training.train_data import passes_line

    total = config.total_steps(world)
    steps = data.steps_per_epoch
    end = min(total, steps * config.num_train_epochs) if steps is not None else total
    share = recipe_lr(config, max(end - 1, 0), total) / config.learning_rate
    return passes_line(steps, config.num_train_epochs, total, share)


@dataclass
class Launch:
    """A launch that passed every check: what `recipes.training.trainer.build_trainer` builds on."""

    accelerator: object
    ds_config: dict
    lock: object  # common.lock.DirectoryLock on the main process, else None
    inputs: RunInputs
    data: object  # recipes.training.train_data.TrainData
    resume_from: Path | None
    signals: object  # recipes.training.run_state.StopSignals

    @property
    def universal(self) -> bool:
        """Resuming a checkpoint of another world size, through DeepSpeed's universal format."""
        manifest = checkpointing.read_manifest(self.resume_from) if self.resume_from else None
        return manifest is not None and manifest["world_size"] != self.accelerator.num_processes


def check_launch(config: PretrainConfig) -> Launch:
    """Distributed setup and every check, before the model is built; the lock is the first thing written, the
    run's config files the last. A collective."""
    from recipes.training import output_dir
    from recipes.training.run_state import StopSignals

    # From here a stop signal waits for the first step boundary (a start can take half an hour at 70B: checksums, an
    # elastic conversion, the model): it used to kill the ranks, exit 1, in that time
    signals = StopSignals()
    accelerator, ds_config = setup_distributed(config)
    configure_logging(accelerator)
    logger.info("collectives: a rank gives up after %s s in one (hang_timeout_s + %d s: the watchdog's stacks come "
                "first)", process_group_timeout_s(), COLLECTIVE_TIMEOUT_MARGIN_S)  # fmt: skip
    if config.elastic:
        logger.info("elastic: %d processes, gradient_accumulation_steps %d (global batch %d rows)",
                    accelerator.num_processes, config.gradient_accumulation_steps,
                    config.global_batch_size)  # fmt: skip
    lock = output_dir.lock(config)  # one writer per directory, taken before anything is written
    if lock is not None:
        atexit.register(lock.release)  # at any exit; after a kill, the dead holder's lock is taken over
    try:
        return checked_launch(config, accelerator, ds_config, lock, signals)
    except BaseException:  # a refusal: let go now, not after the exit code's minute on the Prometheus endpoint
        if lock is not None:
            lock.release()
        raise


def checked_launch(config: PretrainConfig, accelerator, ds_config, lock, signals) -> Launch:
    """`check_launch` once the lock is held."""
    from accelerate.utils import set_seed

    from recipes.training import elastic, output_dir, resume
    from recipes.training.train_data import TrainData

    inputs = preflight(config, accelerator, ds_config)
    set_seed(config.seed)
    world = accelerator.num_processes
    data = TrainData(inputs.train_source, config, inputs.tokenizer, accelerator.process_index, world)
    atexit.register(data.close)  # after multiprocessing's own exit handler, so it runs first
    resume_from = resume.choose_checkpoint(config, accelerator)
    if resume_from:
        verify = lambda path: resume.verify_universal(path, accelerator)  # noqa: E731
        convert = (lambda path: elastic.ensure_universal(path, accelerator, verify)) if config.elastic else None
        resume.check_resumable(resume_from, inputs.identity, inputs.tokenizer, data, world, convert, verify)
        problem = resume.steps_problem(config.total_steps(world), resume_from)
        if problem:
            raise ConfigError(problem)
    if accelerator.is_main_process:
        if resume_from:  # what the run identity lets change is applied: said, so that it is never a surprise
            logger.log(*resume.changes_line(resume_from, config.to_dict()))
        logger.log(*data_passes(config, data, world))
    # on the main process, and an error there stops every rank
    on_main_process(lambda: output_dir.prepare(config, ds_config, inputs.tokenizer), catch=(ConfigError,))
    return Launch(accelerator, ds_config, lock, inputs, data, resume_from, signals)

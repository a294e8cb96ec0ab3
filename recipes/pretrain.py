"""Pretrain a Llama-style model with Accelerate and DeepSpeed ZeRO-3.

    accelerate launch --config_file accelerate_configs/zero3_8gpu.yaml recipes/pretrain.py \
        --config recipes/configs/llama70b_a800x8.yaml [--key value ...]

Reads in the order of the run: config -> distributed setup -> preflight -> data -> model ->
training loop -> export. Mechanisms live in the modules it imports.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script by `accelerate launch recipes/pretrain.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import yaml
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from data_prep.packed_dataset import GlobalBatchSampler, PackedRows, is_preprocessed
from data_prep.packing import document_position_ids
from data_prep.readers import resolve_sources
from data_prep.stream import PackedTextStream
from eval.harness import BenchmarkSettings
from recipes import checkpointing, deepspeed_config, metrics
from recipes.checkpointing import CheckpointError, CheckpointSaveError
from recipes.config import ConfigError, PretrainConfig, load_config, validate_against_model, validate_for_world
from recipes.model import (
    build_model,
    build_optimizer,
    count_parameters,
    detect_attn_implementation,
    enable_chunked_checkpointing,
    llama_config,
    local_parameter_elements,
    replay_cpu_adam_bias_correction,
    training_flops_per_token,
)
from recipes.plan import format_plan, live_hardware, make_plan
from recipes.run_state import (
    EpochBatches,
    LossSpikeRule,
    RunState,
    StopSignals,
    TrainingFault,
    ignore_stop_signals,
)
from recipes.schedule import lr_at_step
from recipes.validation import load_validation_rows, validation_loss

logger = logging.getLogger("pretrain")


def parse_args(argv: list[str] | None = None) -> PretrainConfig:
    parser = argparse.ArgumentParser(description="Pretrain a Llama-style model with DeepSpeed ZeRO-3.")
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/configs/tiny_cpu.yaml")
    parser.add_argument("--resume", help="auto (default), none, or a checkpoint directory")
    args, overrides = parser.parse_known_args(argv)
    if args.resume:
        overrides += ["--resume_from_checkpoint", args.resume]
    return load_config(args.config, overrides)


def setup_distributed(config: PretrainConfig):
    """The Accelerator, with the DeepSpeed JSON's recipe-owned values filled from the recipe."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    if not torch.cuda.is_available():
        # Without CUDA accelerate finds no backend and every rank believes it is rank 0 of 1,
        # while DeepSpeed runs 2: sharding, logging and saving would silently go wrong.
        PartialState(backend="gloo")
    ds_path = deepspeed_config.launched_config_path()
    if ds_path is None:
        raise ConfigError(
            "no DeepSpeed config: launch with `accelerate launch --config_file accelerate_configs/<file>.yaml "
            "recipes/pretrain.py --config ...` (the accelerate config names the ZeRO-3 JSON)"
        )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_for_world(config, world_size)
    ds_config = deepspeed_config.resolve_deepspeed_config(
        deepspeed_config.load_deepspeed_json(ds_path), config, world_size
    )
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config, zero3_init_flag=deepspeed_config.zero3_init_requested())
    accelerator = Accelerator(
        deepspeed_plugin=plugin,
        mixed_precision="bf16" if config.bf16 else "fp16" if config.fp16 else "no",
        gradient_accumulation_steps=config.gradient_accumulation_steps,
    )
    if accelerator.num_processes != world_size:
        raise RuntimeError(f"accelerate sees {accelerator.num_processes} processes but WORLD_SIZE is {world_size}")
    return accelerator, ds_config


def configure_logging(accelerator) -> None:
    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=level, force=True)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # per-task notices; eval.in_loop logs the results
    # DeepSpeed calls torch's deprecated collective names on every step; one warning per call floods the log.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")


def preflight(config: PretrainConfig, accelerator, ds_config):
    """Everything that can be wrong with the inputs, checked before the model costs anything."""
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_name_or_path)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {config.tokenizer_name_or_path} has no EOS token; packing needs one")
    train_sources = training_data(config, tokenizer)
    validation_sources = resolve_sources(config.validation_files, "validation_files")
    model_config = llama_config(config, len(tokenizer))
    validate_against_model(
        config,
        vocab_size=model_config.vocab_size,
        tokenizer_size=len(tokenizer),
        max_positions=model_config.max_position_embeddings,
    )
    benchmarks = benchmark_settings(config)
    if benchmarks:
        benchmarks.check()  # data directories load, before the model costs anything
        logger.info("benchmarks: %s every %d evaluation(s)", ", ".join(benchmarks.tasks), config.eval_benchmarks_every)
    attn_implementation, reason = detect_attn_implementation(config.attn_implementation)
    logger.info("attention: %s (%s)", attn_implementation, reason)
    plan = make_plan(
        config, live_hardware(config, accelerator.num_processes), ds_config, vocab_size=model_config.vocab_size
    )
    logger.info("preflight %s", format_plan(plan, config))
    if not plan.fits and config.preflight_strict:
        raise ConfigError(
            "the plan says this run does not fit:\n  "
            + "\n  ".join(plan.verdicts)
            + "\nChange the recipe or DeepSpeed config, or set preflight_strict: false to try anyway."
        )
    return tokenizer, model_config, attn_implementation, train_sources, validation_sources


def benchmark_settings(config: PretrainConfig) -> BenchmarkSettings | None:
    if not config.eval_tasks:
        return None
    return BenchmarkSettings(
        tasks=list(config.eval_tasks),
        mmlu_dir=config.mmlu_dir,
        gsm8k_dir=config.gsm8k_dir,
        limit=config.eval_limit,
        num_fewshot=config.eval_num_fewshot,
        batch_size=config.per_device_eval_batch_size,
        max_gen_toks=config.eval_max_gen_toks,
    )


def training_data(config: PretrainConfig, tokenizer) -> PackedRows | list[str]:
    """A preprocessed directory (checked against this tokenizer and row length), or raw files."""
    if len(config.train_files) == 1 and is_preprocessed(config.train_files[0]):
        rows = PackedRows(config.train_files[0])
        rows.check_matches(tokenizer, config.tokenizer_name_or_path, config.max_seq_length)
        logger.info("train data: %s, %d preprocessed rows", config.train_files[0], len(rows))
        return rows
    for entry in config.train_files:
        if Path(entry).is_dir():
            raise ConfigError(
                f"train_files: {entry} is a directory without manifest.json; a preprocessing output is complete "
                "only once its manifest is written (run python -m data_prep.preprocess again to finish it), "
                "and it must be the only entry of train_files"
            )
    return resolve_sources(config.train_files, "train_files")


def build_train_loader(config: PretrainConfig, data: PackedRows | list[str], tokenizer, accelerator) -> DataLoader:
    pin_memory = config.dataloader_pin_memory and torch.cuda.is_available()
    if isinstance(data, PackedRows):
        sampler = GlobalBatchSampler(
            len(data),
            config.per_device_train_batch_size,
            config.gradient_accumulation_steps,
            accelerator.num_processes,
            accelerator.process_index,
        )
        return DataLoader(
            data,
            batch_sampler=sampler,
            num_workers=config.dataloader_num_workers,
            pin_memory=pin_memory,
            worker_init_fn=ignore_stop_signals,
        )
    stream = PackedTextStream(
        data,
        tokenizer,
        config.max_seq_length,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        text_field=config.text_field,
    )
    # Not passed to accelerator.prepare: the stream shards by rank itself, and accelerate's
    # dispatching would shard it a second time.
    return DataLoader(
        stream,
        batch_size=config.per_device_train_batch_size,
        num_workers=config.dataloader_num_workers,
        pin_memory=pin_memory,
        drop_last=True,
        worker_init_fn=ignore_stop_signals,
    )


def train(config: PretrainConfig, accelerator, model, optimizer, batches: EpochBatches, state: RunState, hooks):
    """The optimizer-step loop. Every rank runs the same number of steps and the same collectives."""
    world_size, rank = accelerator.num_processes, accelerator.process_index
    total_steps = config.total_steps(world_size)
    min_lr = float(config.lr_scheduler_kwargs.get("min_lr", 0.0))
    writer, signals = hooks["writer"], hooks["signals"]
    progress = tqdm(
        total=total_steps, initial=state.step, disable=not accelerator.is_main_process, desc="train", unit="step"
    )
    window = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss sum, micro-batches, tokens
    window_seconds = 0.0
    stop_reason = "max_steps"
    flags = torch.zeros(2, device=accelerator.device)  # [data exhausted, stop signal], max over ranks
    nonfinite = torch.zeros(world_size, device=accelerator.device)
    spikes = LossSpikeRule(config.loss_spike_factor, config.loss_spike_window) if config.loss_spike_factor else None
    rollbacks = 0
    model.train()
    while state.step < total_steps:
        micro_batches = batches.take(config.gradient_accumulation_steps)
        # Ranks hold different shares of the data and receive signals at different moments: one
        # 2-element all-reduce per optimizer step makes every rank take the same decision.
        flags[0], flags[1] = float(micro_batches is None), float(signals.received is not None)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        if flags[1] > 0:
            stop_reason = "stop signal (SIGTERM/SIGUSR1): saved and exited"
            last = hooks["last_checkpoint"]()
            if last is None or checkpointing.step_of(last) != state.step:
                hooks["save"](state)
            break
        if flags[0] > 0:
            stop_reason = "end of data"
            break

        started = time.perf_counter()
        lr = lr_at_step(
            state.step,
            learning_rate=config.learning_rate,
            warmup_steps=config.warmup_steps,
            total_steps=total_steps,
            lr_scheduler_type=config.lr_scheduler_type,
            min_lr=min_lr,
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_losses = []
        for index, input_ids in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            # DeepSpeed scales the loss by 1/accumulation and steps the optimizer on the boundary.
            accelerator.sync_gradients = last
            input_ids = input_ids.to(accelerator.device, non_blocking=True)
            position_ids = document_position_ids(input_ids, hooks["eos_id"]) if config.document_masking else None
            loss = model(input_ids=input_ids, labels=input_ids, position_ids=position_ids).loss
            step_losses.append(loss.detach())
            if last:
                # Before the backward that steps the optimizer: a NaN/Inf loss on any rank stops all.
                nonfinite.zero_()
                nonfinite[rank] = float(not torch.isfinite(torch.stack(step_losses)).all())
                torch.distributed.all_reduce(nonfinite)
                if nonfinite.any():
                    ranks = [r for r in range(world_size) if nonfinite[r] > 0]
                    raise TrainingFault(
                        f"non-finite loss at step {state.step + 1} on rank(s) {ranks}; the optimizer did not step. "
                        f"Last good checkpoint: {hooks['last_checkpoint']() or 'none'}"
                    )
            accelerator.backward(loss)
            window[0] += loss.detach().double()
            window[1] += 1
            window[2] += input_ids.numel()
        state.step += 1
        window_seconds += time.perf_counter() - started
        progress.update(1)
        grad_norm = model.get_global_grad_norm()
        if grad_norm is not None and not math.isfinite(float(grad_norm)):
            # The same norm on every rank, so every rank raises here. DeepSpeed skips such an update in
            # its overflow check, but a run whose gradients blew up needs a person, not another step.
            raise TrainingFault(
                f"non-finite gradient norm at step {state.step}: stopping without saving. "
                f"Last good checkpoint: {hooks['last_checkpoint']() or 'none'}"
            )

        if spikes is not None:
            # The step's loss over all ranks (one scalar all-reduce; a 70B step takes ~100 s).
            step_loss = accelerator.reduce(torch.stack(step_losses).double().mean(), reduction="mean").item()
            running_mean = spikes.check(step_loss)
            if running_mean is not None:
                last = hooks["last_checkpoint"]()
                act = config.loss_spike_action == "rollback" and last is not None
                act = act and rollbacks < config.loss_spike_max_rollbacks
                logger.warning(
                    "step %d: loss spike %.4f > %.2f x running mean %.4f; %s",
                    state.step,
                    step_loss,
                    config.loss_spike_factor,
                    running_mean,
                    f"rolling back to {last.name}, skipping the data since" if act else "logged only",
                )
                spike = {"loss_spike": step_loss, "loss_running_mean": running_mean, "loss_spike_step": state.step}
                if act:
                    rollbacks += 1
                    hooks["rollback"](last)  # collective: every rank reloads; the data position stays
                    window.zero_()
                    window_seconds = 0.0
                    progress.n = state.step
                    spike["rolled_back_to_step"] = state.step
                writer.write(state.step, spike)
                if act:
                    continue

        if state.step % config.logging_steps == 0 or state.step == total_steps:
            record = log_window(config, accelerator, model, window, window_seconds, lr, hooks["flops_per_token"])
            state.num_tokens += record.pop("window_tokens")
            record["num_tokens"] = state.num_tokens
            writer.write(state.step, record)
            progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            window.zero_()
            window_seconds = 0.0

        evaluate = state.step % config.eval_steps == 0 or state.step == total_steps
        if evaluate and hooks["benchmarks"]:
            evaluation = state.step // config.eval_steps
            if evaluation % config.eval_benchmarks_every == 0 or state.step == total_steps:
                scores = hooks["benchmarks"](state.step)  # every rank; a failure is logged and returns {}
                if scores:
                    writer.write(state.step, scores)
        if hooks["validation_rows"] is not None and evaluate:
            eval_loss = validation_loss(
                model,
                accelerator,
                hooks["validation_rows"],
                config.per_device_eval_batch_size,
                eos_id=hooks["eos_id"] if config.document_masking else None,
            )
            writer.write(state.step, {"eval_loss": eval_loss})
            logger.info("step %d: eval_loss %.4f", state.step, eval_loss)
            # eval_loss is all-reduced, so every rank takes the same early-stopping decision.
            best = state.best_eval_loss
            if best is None or eval_loss < best - config.early_stopping_threshold:
                state.best_eval_loss, state.evaluations_without_improvement = eval_loss, 0
                state.best_checkpoint = f"checkpoint-{state.step}"
                hooks["save"](state)  # the best model is always on disk, and protected from rotation
                continue
            state.evaluations_without_improvement += 1
            patience = config.early_stopping_patience
            if patience and state.evaluations_without_improvement >= patience:
                stop_reason = (
                    f"early stopping: no eval_loss improvement in {state.evaluations_without_improvement} "
                    f"evaluations (best {state.best_eval_loss:.4f} at {state.best_checkpoint})"
                )
                hooks["save"](state)
                break

        if state.step % config.save_steps == 0 or state.step == total_steps:
            hooks["save"](state)
    progress.close()
    return stop_reason


def benchmarks_hook(config: PretrainConfig, accelerator, model, tokenizer, output_dir: Path):
    """step -> benchmark scores, run on every rank; None when `eval_tasks` is empty."""
    settings = benchmark_settings(config)
    if settings is None:
        return None
    from eval.in_loop import run_benchmarks

    return lambda step: run_benchmarks(model, accelerator, tokenizer, settings, step, output_dir)


def log_window(config, accelerator, model, window, window_seconds, lr, flops_per_token) -> dict:
    """Metrics over the steps since the last log, reduced over ranks (a collective on every rank)."""
    totals = accelerator.reduce(window.clone(), reduction="sum")
    memory = torch.tensor(
        [metrics.peak_host_memory_gb(), metrics.peak_gpu_memory_gb() or 0.0], device=accelerator.device
    )
    memory = accelerator.reduce(memory, reduction="max")
    # Ranks step in lockstep, so the slowest rank's time is the window's wall time; the tokens are
    # what all ranks consumed together, each counting only its own micro-batches.
    seconds = accelerator.reduce(torch.tensor([window_seconds], device=accelerator.device), reduction="max").item()
    window_tokens = int(totals[2].item())
    window_steps = int(totals[1].item()) // (config.gradient_accumulation_steps * accelerator.num_processes)
    tokens_per_s = metrics.tokens_per_second(window_tokens, seconds)
    grad_norm = model.get_global_grad_norm()
    record = {
        "loss": totals[0].item() / totals[1].item(),
        "lr": lr,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens_per_s": tokens_per_s,
        "mfu": metrics.model_flops_utilization(
            tokens_per_s, flops_per_token, accelerator.num_processes, config.peak_tflops_per_device
        ),
        "peak_host_memory_gb": memory[0].item(),
        "step_time_s": seconds / window_steps,
        "window_tokens": window_tokens,
    }
    if torch.cuda.is_available():
        record["peak_gpu_memory_gb"] = memory[1].item()
    logger.info(
        "loss %.4f | lr %.3g | grad_norm %.3f | %.0f tokens/s | MFU %s | host %.2f GB",
        record["loss"],
        lr,
        record["grad_norm"] or float("nan"),
        tokens_per_s,
        "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%",
        record["peak_host_memory_gb"],
    )
    return record


def main(argv: list[str] | None = None) -> int:
    run_started = time.perf_counter()
    try:
        config = parse_args(argv)
        accelerator, ds_config = setup_distributed(config)
        configure_logging(accelerator)
        tokenizer, model_config, attn_implementation, train_data, validation_sources = preflight(
            config, accelerator, ds_config
        )
        resumed_from = find_checkpoint(config, accelerator)
        # From here on a preemption signal waits for the loop's next step boundary instead of killing.
        signals = StopSignals()
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr)
        return 2

    output_dir = Path(config.output_dir)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        checkpointing.write_resolved_config(output_dir, config.to_dict())
        (output_dir / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=2, default=str))
    from accelerate.utils import gather_object, set_seed

    set_seed(config.seed)

    batches = EpochBatches(build_train_loader(config, train_data, tokenizer, accelerator), config.num_train_epochs)
    # Registered after multiprocessing's own exit handler, so it runs first (atexit is last-in, first-out).
    atexit.register(batches.close)
    validation_rows = None
    if validation_sources:
        validation_rows = load_validation_rows(
            validation_sources, tokenizer, config.max_seq_length, config.text_field, config.max_eval_samples
        )
        logger.info("validation: %d rows of %d tokens", len(validation_rows), config.max_seq_length)

    dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
    model = build_model(config, model_config, attn_implementation, dtype)
    num_params = count_parameters(model)
    logger.info(
        "model: %.4g parameters; this rank holds %d elements after partitioned init",
        num_params,
        local_parameter_elements(model),
    )
    if config.gradient_checkpointing:
        chunks = enable_chunked_checkpointing(model, config.gradient_checkpointing_layers_per_checkpoint)
        logger.info(
            "gradient checkpointing: %d checkpoints of %d layer(s)",
            chunks,
            config.gradient_checkpointing_layers_per_checkpoint,
        )
    optimizer = build_optimizer(model, config, deepspeed_config.offloads_optimizer(ds_config))
    if resumed_from and checkpointing.read_manifest(resumed_from)["world_size"] != accelerator.num_processes:
        # read by DeepSpeed when the engine is built: load_checkpoint then takes the universal format
        accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    model, optimizer = accelerator.prepare(model, optimizer)

    state = RunState()
    if resumed_from:
        restore(resumed_from, accelerator, model, optimizer, batches, state, config)
    writer = metrics.MetricsWriter(output_dir, accelerator.is_main_process, config.prometheus_port)
    last_checkpoint: list[Path] = [resumed_from] if resumed_from else []

    def rollback(path: Path) -> None:
        """The checkpoint's model, optimizer, RNG and run state; the data position is kept, so the window
        between the checkpoint and the spike is skipped rather than trained on again."""
        load_checkpoint_state(path, accelerator, model, optimizer, state, config)

    def save(state: RunState) -> None:
        positions = gather_object([batches.position()])
        data_position = {
            "kind": "preprocessed" if isinstance(train_data, PackedRows) else "stream",
            "per_rank": positions,
            # Preprocessed rows are addressed globally: every rank has consumed the same count.
            "global_rows_consumed": positions[0]["rows_consumed"] * accelerator.num_processes,
            "world_size": accelerator.num_processes,
            "dataloader_num_workers": config.dataloader_num_workers,
        }
        extra = {"run_state": asdict(state), "data_position": data_position}
        path = checkpointing.save_checkpoint(accelerator, output_dir, state.step, extra, config.to_dict())
        best = output_dir / state.best_checkpoint if state.best_checkpoint else None
        checkpointing.rotate_checkpoints(accelerator, output_dir, config.save_total_limit, best)
        last_checkpoint[:] = [path]
        writer.write(state.step, {"last_checkpoint_step": state.step})
        logger.info("step %d: saved %s", state.step, path)

    hooks = {
        "flops_per_token": training_flops_per_token(
            num_params, model_config.num_hidden_layers, config.max_seq_length, model_config.hidden_size
        ),
        "validation_rows": validation_rows,
        "eos_id": tokenizer.eos_token_id,
        "benchmarks": benchmarks_hook(config, accelerator, model, tokenizer, output_dir),
        "save": save,
        "rollback": rollback,
        "writer": writer,
        "signals": signals,
        "last_checkpoint": lambda: last_checkpoint[0] if last_checkpoint else None,
    }
    try:
        stop_reason = train(config, accelerator, model, optimizer, batches, state, hooks)
    except TrainingFault as error:
        logger.error("%s", error)
        writer.close()
        return 3
    except CheckpointSaveError as error:
        # Stop rather than train on without checkpoints: a run that cannot save is a week at risk.
        logger.error("%s", error)
        writer.close()
        return 4
    logger.info("training stopped after %d steps: %s", state.step, stop_reason)
    if stop_reason.startswith("stop signal"):
        writer.close()
        return 0
    if stop_reason.startswith("early stopping") and state.best_checkpoint:
        logger.info("exporting the best checkpoint, %s, to final/", state.best_checkpoint)
        accelerator.load_state(str(output_dir / state.best_checkpoint))  # collective

    final_dir = checkpointing.export_final(accelerator, model, tokenizer, output_dir, config.to_dict())
    peaks = accelerator.gather(torch.tensor([metrics.peak_host_memory_gb()], device=accelerator.device)).tolist()
    if accelerator.is_main_process:
        metrics.plot_losses(output_dir / "metrics.jsonl", output_dir / "loss.png")
        summary = {
            "steps": state.step,
            "stop_reason": stop_reason,
            "best_eval_loss": state.best_eval_loss,
            "best_checkpoint": state.best_checkpoint,
            "resumed_from": str(resumed_from) if resumed_from else None,
            "wall_seconds": time.perf_counter() - run_started,
            "num_parameters": num_params,
            "peak_host_memory_gb_per_rank": peaks,
            "attn_implementation": attn_implementation,
        }
        (output_dir / "run_summary.json").write_text(json.dumps(summary, indent=2))
        (output_dir / "report.md").write_text(metrics.run_report(output_dir))
        logger.info("model: %s", final_dir)
        logger.info("metrics: %s (TensorBoard: %s)", output_dir / "metrics.jsonl", output_dir / "tensorboard")
        logger.info("loss plot: %s", output_dir / "loss.png")
    writer.close()
    accelerator.end_training()
    return 0


def find_checkpoint(config: PretrainConfig, accelerator) -> Path | None:
    """The checkpoint to resume from, checked against this launch before any model is built."""
    path, notes = checkpointing.find_resume_checkpoint(config.output_dir, config.resume_from_checkpoint)
    for note in notes:
        logger.warning("resume: %s", note)
    if path is None:
        logger.info("resume: starting from scratch (resume_from_checkpoint=%s)", config.resume_from_checkpoint)
        return None
    manifest = checkpointing.read_manifest(path)
    if manifest["world_size"] != accelerator.num_processes:
        problem = world_size_change_problem(config, manifest, path, accelerator.num_processes)
        if problem:
            raise CheckpointError(problem)
        logger.warning(
            "resume: %s was written by %d processes; loading its universal checkpoint on %d. Per-rank RNG states "
            "do not carry over (reseeded from seed + step), so the run continues exactly but not bit-identically",
            path,
            manifest["world_size"],
            accelerator.num_processes,
        )
        return path
    workers = manifest["data_position"]["dataloader_num_workers"]
    # A stream's position is per (rank, worker) shard; a preprocessed directory's is one global row index.
    if manifest["data_position"].get("kind") != "preprocessed" and workers != config.dataloader_num_workers:
        raise CheckpointError(
            f"{path} was written with dataloader_num_workers={workers}; the data position depends on it, so "
            f"resume with the same value (this launch: {config.dataloader_num_workers})"
        )
    return path


def world_size_change_problem(config: PretrainConfig, manifest: dict, path: Path, world_size: int) -> str | None:
    """Why a checkpoint written by another number of processes cannot be resumed here (None: it can)."""
    saved_world = manifest["world_size"]
    head = f"{path} was written by {saved_world} processes, this launch has {world_size}"
    if manifest["data_position"].get("kind") != "preprocessed":
        return (
            f"{head}. The raw-text data position is per rank and dataloader worker, so it cannot move to another "
            f"world size: relaunch on {saved_world} processes, or train from a preprocessed directory "
            "(python -m data_prep.preprocess), whose position is a global row index"
        )
    saved = yaml.safe_load((path / checkpointing.RESOLVED_CONFIG).read_text())
    saved_batch = saved["per_device_train_batch_size"] * saved["gradient_accumulation_steps"] * saved_world
    if saved_batch != config.resolved_global_batch_size(world_size):
        return (
            f"{head}, with a global batch of {saved_batch} rows; this launch's is "
            f"{config.resolved_global_batch_size(world_size)}. Keep the global batch (micro-batch x accumulation x "
            "processes) when changing the number of GPUs: the step count and the data position depend on it"
        )
    if not checkpointing.has_universal(path):
        return (
            f"{head}. ZeRO-3 shards are per rank: convert the checkpoint once with DeepSpeed's universal format, "
            f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {path}/pytorch_model "
            f"--output_folder {path}/{checkpointing.UNIVERSAL_DIR}/pytorch_model , then relaunch"
        )
    return None


def load_checkpoint_state(path: Path, accelerator, model, optimizer, state: RunState, config: PretrainConfig) -> dict:
    """Model, optimizer, RNG states and run state from `path` (a collective), and `metrics.jsonl` cut back to
    its step; returns its manifest. From the universal checkpoint when the world size changed (per-rank RNG
    states are then reseeded). Resume and loss-spike rollback both go through here."""
    manifest = checkpointing.read_manifest(path)
    same_world = manifest["world_size"] == accelerator.num_processes
    if same_world:
        accelerator.load_state(str(path))  # every rank loads its own shards and RNG states
    else:  # needs `checkpoint.load_universal` in the DeepSpeed config (set in main)
        model.load_checkpoint(str(path / checkpointing.UNIVERSAL_DIR), tag="pytorch_model")
    replay_cpu_adam_bias_correction(optimizer)
    saved = json.loads((path / "trainer_state.json").read_text())["run_state"]
    for key, value in saved.items():
        setattr(state, key, value)
    if not same_world:
        from accelerate.utils import set_seed

        set_seed(config.seed + state.step)
    if accelerator.is_main_process:
        metrics.truncate_metrics(Path(config.output_dir) / "metrics.jsonl", after_step=state.step)
    return manifest


def restore(path: Path, accelerator, model, optimizer, batches: EpochBatches, state: RunState, config) -> None:
    """Everything `load_checkpoint_state` restores, and the data position, exactly as at the save."""
    position = load_checkpoint_state(path, accelerator, model, optimizer, state, config)["data_position"]
    if position.get("kind") == "preprocessed":
        rows = position["global_rows_consumed"] // accelerator.num_processes
        batches.restore(position["per_rank"][0]["epoch"], rows)
    else:
        mine = position["per_rank"][accelerator.process_index]
        batches.restore(mine["epoch"], mine["rows_consumed"])
    logger.info("resume: continuing from %s at step %d", path, state.step)


if __name__ == "__main__":
    sys.exit(main())

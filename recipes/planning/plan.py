"""Plan before you spend: a recipe's memory, time, cost and benchmark price on given hardware, and a verdict.

Sources of the terms: ZeRO-3 model states as DeepSpeed's `estimate_zero3_model_states_mem_needs` counts them;
activations per Korthikanti et al. 2022 (34·s·b·h bytes per layer in 16-bit with a fused attention kernel, no s²
term); FLOPs per token 6N + 12·L·s·h (PaLM, appendix B). Step time from the communication model of
`recipes.planning.step_time` on the hardware profile's wires; a fixed `mfu` replaces it. Pure arithmetic: nothing is
allocated, so a 70B plan takes well under a second, and `recipes/pretrain.py` runs the same plan as its preflight.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from eval import SPLITS_REQUESTS_OVER_RANKS
from recipes.architecture import (
    DEFAULT_MAX_POSITION_EMBEDDINGS,
    gathered_units,
    hooked_modules,
    largest_leaf,
    llama_parameter_count,
    module_sizes,
    parameter_tensors,
    training_flops_per_token,
    unknown_leaf_classes,
)
from recipes.config import (
    MODEL_CONFIG_KEYS,
    ConfigError,
    PretrainConfig,
    for_world,
    missing_model_sizes,
    validate_against_model,
    validate_for_world,
    warmup_fraction,
)
from recipes.planning.eval_cost import MMLU_SUBJECTS, SHARE_WARNING, EvalCost, EvalWork, eval_cost, wall_days
from recipes.planning.hardware import DEFAULT_MFU, Hardware
from recipes.planning.memory import (
    ASSUMED_VOCAB_SIZE,
    DEEPSPEED_HOST_BUFFER_FACTOR,
    checkpoint_terms,
    deepspeed_host_estimate_gb,
    eval_rows_that_fit,
    gpu_memory_terms,
    host_memory_terms,
)
from recipes.planning.step_time import StepTime, Workload, Zero3, collective_s, host_s_per_pass, step_time
from recipes.planning.units import format_duration, gb_text

DEFAULT_DEEPSPEED_JSON = Path(__file__).resolve().parents[2] / "accelerate_configs" / "deepspeed" / "zero3.json"


@dataclass
class Plan:
    params: int
    largest_layer_params: int  # the largest unit ZeRO-3 gathers at once: a module, or a whole leaf (a decoder layer)
    hooked_modules: int  # modules with parameters ZeRO-3 hooks, a leaf counting once (zero3_leaf_modules)
    num_layers: int
    vocab_size: int
    total_steps: int
    warmup_fraction: float
    flops_per_token: float
    hardware_flops_per_token: float
    per_gpu_memory_gb: dict[str, float]
    model_states_gpu_gb: float
    host_memory_per_node_gb: float
    host_memory_terms_gb: dict[str, float]
    deepspeed_host_estimate_gb: float
    peak_tokens_per_s: float | None
    expected_tokens_per_s: float | None
    step_time_s: float | None
    step_time_breakdown_s: dict[str, float] | None  # per micro-batch: compute, communication,
    # exposed_communication; per step: optimizer (CPU Adam and the upload of the updated parameters)
    predicted_mfu: float | None
    bound: str | None  # "compute" or "communication", per micro-batch
    modelled_step_s: float | None
    accumulation: int
    wires: dict[str, float]
    expected_days: float | None
    gpu_hours: float | None
    checkpoint_gb: float
    checkpoint_disk_gb: float
    conversion_disk_gb: float  # more, at the peak of an elastic resume's conversion
    checkpoint_verify_s: float
    checkpoint_save_s: float
    eval_documents: dict[str, int] | None  # in-loop benchmarks: documents per evaluation, per task
    eval_forward_passes: int | None  # per rank and evaluation, each one gathering the whole model
    eval_seconds: float | None
    eval_seconds_by_task: dict[str, float] | None
    eval_share: float | None  # of the training time between two benchmark evaluations
    eval_batch_fits: int | None  # the largest per_device_eval_batch_size the memory left during evaluation holds
    fits: bool
    wall_days: float | None = None  # expected_days with the in-loop benchmarks' and the checkpoint saves' time
    verdicts: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    hardware: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def resolve_vocab_size(config: PretrainConfig, warnings: list[str]) -> int:
    if "vocab_size" in config.model_config:
        return int(config.model_config["vocab_size"])
    tokenizer_dir = Path(config.tokenizer_name_or_path)
    if tokenizer_dir.is_dir():
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(tokenizer_dir))
    warnings.append(
        f"vocabulary size assumed {ASSUMED_VOCAB_SIZE:,} (tokenizer {config.tokenizer_name_or_path} is not here); "
        "set model_config.vocab_size to plan exactly"
    )
    return ASSUMED_VOCAB_SIZE


def model_shape(config: PretrainConfig, warnings: list[str]) -> dict[str, Any]:
    """The Llama shape: `model_config`, or the config.json of a local `model_name_or_path`."""
    if not config.model_name_or_path:
        return dict(config.model_config)
    from transformers import AutoConfig

    try:
        loaded = AutoConfig.from_pretrained(config.model_name_or_path)
    except OSError as error:
        raise ConfigError(f"model_name_or_path {config.model_name_or_path}: cannot read its config ({error})") from None
    shape = {k: getattr(loaded, k) for k in MODEL_CONFIG_KEYS if getattr(loaded, k, None) is not None}
    missing = missing_model_sizes(shape)
    if missing:
        raise ConfigError(f"model_name_or_path {config.model_name_or_path}: its config has no {', '.join(missing)} "
                          "(not a Llama model?)")  # fmt: skip
    return shape


def predicted_step(config: PretrainConfig, hardware: Hardware, ds_config: dict[str, Any], shape: dict[str, Any],
                   params: int, flops_per_token: float) -> StepTime | None:  # fmt: skip
    """The communication model's step (None without a hardware profile or a peak)."""
    wires = hardware.step_model()
    if wires is None or not hardware.peak_tflops:
        return None
    zero = Zero3.from_json(ds_config)
    world, micro = hardware.gpus, config.per_device_train_batch_size
    rows = config.resolved_global_batch_size(world)
    sizes = module_sizes(shape)
    layer_params = sum(count * size for count, size in sizes[1:-1]) // shape["num_hidden_layers"]
    recompute = 4 / 3 if config.gradient_checkpointing else 1.0
    work = Workload(
        params=params,
        persistent_params=sum(count * size for count, size in sizes if size < zero.persistence_threshold),
        layer_params=layer_params,
        layers_per_checkpoint=config.gradient_checkpointing_layers_per_checkpoint if config.gradient_checkpointing
        else 0,
        hardware_flops_per_token=flops_per_token * recompute,
        useful_flops_per_token=flops_per_token,
        tokens_per_micro_batch=micro * config.max_seq_length,
        accumulation=rows // (micro * world),
        gpus=world,
        nodes=hardware.nodes,
        hooked_modules=hooked_modules(shape, config.zero3_leaf_modules),
        parameter_tensors=parameter_tensors(shape),
    )  # fmt: skip
    return step_time(work, zero, wires)


def time_terms(config: PretrainConfig, hardware: Hardware, flops_per_token: float, step: StepTime | None) -> tuple:
    """(ceiling tokens/s, expected tokens/s, step seconds, days, GPU-hours); all None without a peak. The expected
    rate is the communication model's step, or the fixed `mfu` when one is given. MFU counts useful FLOPs only:
    recomputation is extra hardware work (one more forward)."""
    if not hardware.peak_tflops or (step is None and hardware.mfu is None):
        return None, None, None, None, None
    world, rows = hardware.gpus, config.resolved_global_batch_size(hardware.gpus)
    tokens = config.total_steps(world) * rows * config.max_seq_length
    peak = world * hardware.peak_tflops * 1e12 / flops_per_token
    expected = peak * hardware.mfu if hardware.mfu is not None else rows * config.max_seq_length / step.step
    days = tokens / expected / 86_400
    return peak, expected, rows * config.max_seq_length / expected, days, days * 24 * world


def _wire_numbers(hardware: Hardware) -> dict[str, float]:
    wires = hardware.step_model()
    if wires is None:
        return {}
    numbers = {"peak TFLOPs": wires.peak_tflops, "intra-node GB/s": wires.intra_node_gb_s,
               "inter-node GB/s": wires.inter_node_gb_s, "host link GB/s": wires.host_link_gb_s,
               "host memory GB/s": wires.host_memory_gb_s, "compute efficiency": wires.compute_efficiency,
               "overlap": wires.overlap}  # fmt: skip
    return {key: round(value, 3) for key, value in numbers.items() if value is not None}


def local_mmlu_subjects(mmlu_dir: str | None) -> int:
    """Subjects in a local MMLU directory that is here; all 57 otherwise (the hub, or a cluster path)."""
    if not mmlu_dir or not Path(mmlu_dir).is_dir():
        return MMLU_SUBJECTS
    from data_prep.benchmark_files.layouts import BenchmarkDataError, mmlu_layout

    try:
        return len(mmlu_layout(mmlu_dir)[1])
    except BenchmarkDataError:  # a malformed directory is preflight's to report
        return MMLU_SUBJECTS


def price_evaluation(config: PretrainConfig, hardware: Hardware, ds_config: dict[str, Any], shape: dict[str, Any],
                     params: int, step_seconds: float | None) -> EvalCost | None:  # fmt: skip
    """The in-loop benchmarks' cost per evaluation (None without benchmarks or without a peak to price compute)."""
    if not config.eval_tasks or not hardware.peak_tflops:
        return None
    wires = hardware.step_model()
    if wires is not None:
        zero = Zero3.from_json(ds_config)
        persistent = sum(count * size for count, size in module_sizes(shape) if size < zero.persistence_threshold)
        gather_s = collective_s(2.0 * (params - persistent), wires, hardware.gpus, hardware.nodes)
        flops_per_s = hardware.peak_tflops * 1e12 * wires.compute_efficiency
    else:  # a fixed MFU and no wires: the gathers are not priced
        gather_s, flops_per_s = 0.0, hardware.peak_tflops * 1e12 * (hardware.mfu or DEFAULT_MFU)
    work = EvalWork(
        tasks=tuple(config.eval_tasks),
        limit=config.eval_limit,
        num_fewshot=config.eval_num_fewshot,
        batch_size=config.per_device_eval_batch_size,
        max_gen_toks=config.eval_max_gen_toks,
        ranks_sharing=hardware.gpus if SPLITS_REQUESTS_OVER_RANKS else 1,
        mmlu_subjects=local_mmlu_subjects(config.mmlu_dir),
    )
    between = step_seconds * config.eval_steps * config.eval_benchmarks_every if step_seconds else None
    host_s = host_s_per_pass(hooked_modules(shape, config.zero3_leaf_modules), parameter_tensors(shape))
    return eval_cost(work, params=params, gather_s=gather_s, flops_per_s=flops_per_s, host_s_per_forward=host_s,
                     training_s_between=between)  # fmt: skip


def eval_terms(evaluation: EvalCost | None) -> dict[str, Any]:
    """The plan's `eval_*` fields (all None without benchmarks to price)."""
    if evaluation is None:
        return dict.fromkeys(("eval_documents", "eval_forward_passes", "eval_seconds", "eval_seconds_by_task",
                              "eval_share"))  # fmt: skip
    return {"eval_documents": evaluation.documents, "eval_forward_passes": evaluation.forward_passes,
            "eval_seconds": evaluation.seconds, "eval_seconds_by_task": evaluation.seconds_by_task,
            "eval_share": evaluation.share}  # fmt: skip


def planned_shape(config: PretrainConfig, vocab_size: int | None, warnings: list[str]) -> dict[str, Any]:
    """The model shape with its vocabulary: given, the recipe's, or the local tokenizer's."""
    shape = model_shape(config, warnings)
    if vocab_size:
        shape["vocab_size"] = vocab_size
    elif "vocab_size" not in shape:
        shape["vocab_size"] = resolve_vocab_size(config, warnings)
    return shape


def as_trained(config: PretrainConfig, shape: dict[str, Any], warnings: list[str]) -> PretrainConfig:
    """The recipe checked against the model shape as training checks it (validate_against_model), with checkpoint
    chunks as training cuts them: never more layers than the model has (recipes.training.model)."""
    positions = shape.get("max_position_embeddings") or DEFAULT_MAX_POSITION_EMBEDDINGS
    validate_against_model(config, vocab_size=shape["vocab_size"], max_positions=positions)
    layers, every = shape["num_hidden_layers"], config.gradient_checkpointing_layers_per_checkpoint
    if config.gradient_checkpointing and every > layers:
        warnings.append(f"gradient_checkpointing_layers_per_checkpoint {every} is more than the model's {layers} "
                        f"layers: training checkpoints all {layers} as one")  # fmt: skip
        return replace(config, gradient_checkpointing_layers_per_checkpoint=layers)
    return config


def make_plan(
    config: PretrainConfig,
    hardware: Hardware,
    ds_config: dict[str, Any],
    *,
    vocab_size: int | None = None,
    target_tokens_per_s: float | None = None,
) -> Plan:
    """The whole plan; every number derives from the recipe, the DeepSpeed config and the hardware."""
    config = for_world(config, hardware.gpus)
    validate_for_world(config, hardware.gpus)
    warnings: list[str] = []
    shape = planned_shape(config, vocab_size, warnings)
    config = as_trained(config, shape, warnings)
    params, _ = llama_parameter_count(**shape)
    largest = max(size for _, size in gathered_units(shape, config.zero3_leaf_modules))  # what is gathered at once
    world, seq = hardware.gpus, config.max_seq_length
    memory, model_states_gpu = gpu_memory_terms(config, shape, params, largest, world, ds_config)
    host = host_memory_terms(config, params, hardware, ds_config)
    flops = training_flops_per_token(params, shape["num_hidden_layers"], seq, shape["hidden_size"])
    modelled = predicted_step(config, hardware, ds_config, shape, params, flops)
    peak, expected, step_seconds, days, gpu_hours = time_terms(config, hardware, flops, modelled)

    plan = Plan(
        params=params,
        largest_layer_params=largest,
        hooked_modules=hooked_modules(shape, config.zero3_leaf_modules),
        num_layers=shape["num_hidden_layers"],
        vocab_size=shape["vocab_size"],
        total_steps=config.total_steps(world),
        warmup_fraction=warmup_fraction(config, world),
        flops_per_token=flops,
        hardware_flops_per_token=flops * (4 / 3 if config.gradient_checkpointing else 1.0),
        per_gpu_memory_gb=memory,
        model_states_gpu_gb=round(model_states_gpu, 3),
        host_memory_per_node_gb=round(sum(host.values()), 3),
        host_memory_terms_gb=host,
        deepspeed_host_estimate_gb=deepspeed_host_estimate_gb(params, hardware, ds_config),
        peak_tokens_per_s=peak,
        expected_tokens_per_s=expected,
        step_time_s=step_seconds,
        step_time_breakdown_s=modelled.breakdown() if modelled else None,
        predicted_mfu=modelled.predicted_mfu if modelled else None,
        bound=modelled.bound if modelled else None,
        modelled_step_s=modelled.step if modelled else None,
        accumulation=config.resolved_global_batch_size(world) // (config.per_device_train_batch_size * world),
        wires=_wire_numbers(hardware),
        expected_days=days,
        gpu_hours=gpu_hours,
        **checkpoint_terms(config, params, world),
        **eval_terms(price_evaluation(config, hardware, ds_config, shape, params, step_seconds)),
        eval_batch_fits=eval_rows_that_fit(config, shape, memory, hardware.gpu_memory_gb),
        fits=True,
        warnings=warnings,
        hardware={**asdict(hardware), "device": hardware.device, "devices": hardware.devices},
    )
    plan.wall_days = wall_days(days, plan.eval_share, plan.total_steps // config.save_steps, plan.checkpoint_save_s)
    _judge(plan, config, hardware, target_tokens_per_s)
    _leaf_warnings(plan, config, ds_config, shape)
    return plan


def _leaf_warnings(plan: Plan, config: PretrainConfig, ds_config: dict[str, Any], shape: dict[str, Any]) -> None:
    """What leaf modules ask of ZeRO-3's prefetch. DeepSpeed prefetches when a hooked module is fetched, up to
    `stage3_prefetch_bucket_size` elements and as long as fewer than `stage3_max_live_parameters` are gathered: with a
    whole layer per fetch, both must hold a layer, and two, for the next one's gather to run during this one's compute
    (the checkpointed chunk releases each layer before it fetches the next: recipes.training.model)."""
    unknown = unknown_leaf_classes(config.zero3_leaf_modules)
    if unknown:
        plan.warnings.append(f"zero3_leaf_modules {unknown}: not Llama classes the planner knows; it counts the "
                             "modules inside them one by one")  # fmt: skip
    leaf = largest_leaf(shape, config.zero3_leaf_modules)
    if leaf is None or leaf == plan.params:
        return
    zero = ds_config.get("zero_optimization", {})
    bucket = float(zero.get("stage3_prefetch_bucket_size", 5e7))
    live = float(zero.get("stage3_max_live_parameters", 1e9))
    prefetched = max(0.0, min(bucket, live - leaf, leaf)) / leaf
    if prefetched < 1:
        plan.warnings.append(
            f"with leaf modules ZeRO-3 gathers {leaf / 1e6:,.0f}M parameters at once, but can prefetch only "
            f"{prefetched:.0%} of the next leaf (stage3_prefetch_bucket_size {bucket:.3g}, stage3_max_live_parameters "
            f"{live:.3g}): set them to at least {rounded_up(leaf):.2g} and {rounded_up(2 * leaf):.2g} for its gather "
            "to overlap compute"
        )


def rounded_up(count: float) -> float:
    """`count` rounded up to two significant digits: advice that, taken, silences the warning that gives it."""
    step = 10.0 ** (math.floor(math.log10(count)) - 1)
    return math.ceil(count / step) * step


def _judge(plan: Plan, config: PretrainConfig, hardware: Hardware, target_tokens_per_s: float | None) -> None:
    """The verdict (fits or not, by which terms) and the warnings a plan carries."""
    _memory_verdicts(plan, hardware)
    _warnings(plan, config, hardware, target_tokens_per_s)
    _evaluation_warnings(plan, config)


def _memory_verdicts(plan: Plan, hardware: Hardware) -> None:
    memory = plan.per_gpu_memory_gb
    if hardware.gpu_memory_gb is not None and memory["total"] > hardware.gpu_memory_gb:
        plan.fits = False
        terms = sorted(((v, k) for k, v in memory.items() if k != "total"), reverse=True)[:3]
        biggest = ", ".join(f"{k} {v:.1f} GB" for v, k in terms)
        plan.verdicts.append(
            f"does not fit: {memory['total']:.1f} GB per GPU needed, {gb_text(hardware.gpu_memory_gb)} available; "
            f"largest terms: {biggest}"
        )
    if hardware.host_memory_gb is not None and plan.host_memory_per_node_gb > hardware.host_memory_gb:
        plan.fits = False
        plan.verdicts.append(
            f"does not fit: {plan.host_memory_per_node_gb:.0f} GB of host memory per node needed, "
            f"{gb_text(hardware.host_memory_gb)} available (the largest term: {largest_host_term(plan)})"
        )
    if plan.fits:
        plan.verdicts.append(
            f"fits: {gb_text(memory['total'])} per {hardware.device}"
            + (f" of {gb_text(hardware.gpu_memory_gb)}" if hardware.gpu_memory_gb else "")
            + f", {gb_text(plan.host_memory_per_node_gb)} host memory per node"
            + (f" of {gb_text(hardware.host_memory_gb)}" if hardware.host_memory_gb else "")
        )


def _warnings(plan: Plan, config: PretrainConfig, hardware: Hardware, target_tokens_per_s: float | None) -> None:
    host, available = plan.host_memory_per_node_gb, hardware.host_memory_gb
    if available is not None and (plan.deepspeed_host_estimate_gb > available or host > 0.9 * available):
        plan.warnings.append(
            f"host memory per node: {host:,.0f} GB of {gb_text(available)} ({host / available:.0%}), "
            f"{max(available - host, 0):,.0f} GB left for the OS, the page cache and anything else on the node; "
            f"DeepSpeed's estimator, with its {DEEPSPEED_HOST_BUFFER_FACTOR}x buffer factor, asks "
            f"{plan.deepspeed_host_estimate_gb:,.0f} GB"
        )
    if plan.peak_tokens_per_s and target_tokens_per_s and target_tokens_per_s > plan.peak_tokens_per_s:
        plan.warnings.append(
            f"the target of {target_tokens_per_s:,.0f} tokens/s is {target_tokens_per_s / plan.peak_tokens_per_s:.1f}x "
            f"the physical ceiling of {plan.peak_tokens_per_s:,.0f} tokens/s at 100% MFU"
        )
    if hardware.mfu is not None and hardware.mfu > 0.6:
        plan.warnings.append(f"MFU {hardware.mfu:.0%} is above what published large runs reach (45-55%)")
    if not 0.001 <= plan.warmup_fraction <= 0.1:
        plan.warnings.append(
            f"warmup is {plan.warmup_fraction:.2%} of training ({config.warmup_steps:,} of {plan.total_steps:,} "
            "steps); 0.1-10% is usual"
        )
    if plan.params > 1e9 and not config.gradient_checkpointing:
        plan.warnings.append("gradient checkpointing is off for a >1B model: activations dominate memory")
    if plan.expected_days and plan.expected_days > 365:
        plan.warnings.append(
            f"the token budget takes {plan.expected_days / 365:.1f} years at "
            f"{hardware.mfu if hardware.mfu is not None else plan.predicted_mfu:.0%} MFU on {hardware.gpus} "
            f"{hardware.devices}"
        )


def _evaluation_warnings(plan: Plan, config: PretrainConfig) -> None:
    if plan.eval_share is not None and plan.eval_share > SHARE_WARNING:
        plan.warnings.append(
            f"benchmarks take {plan.eval_share:.0%} of the training time between evaluations "
            f"({format_duration(plan.eval_seconds)} per evaluation, {plan.eval_forward_passes:,} forward passes per "
            f"rank, each gathering the whole model): set eval_limit, raise per_device_eval_batch_size, lower "
            "eval_max_gen_toks or evaluate less often (eval_benchmarks_every)"
        )
    if plan.eval_batch_fits is not None and config.per_device_eval_batch_size > plan.eval_batch_fits:
        plan.warnings.append(
            f"per_device_eval_batch_size {config.per_device_eval_batch_size} is more than the {plan.eval_batch_fits} "
            "rows that fit in the memory left while evaluating: validation or benchmarks may run out of memory"
        )


def plan_predictions(plan: Plan) -> dict[str, float | None]:
    """What a run measures too, under the names its metrics use (recipes.telemetry.metrics.plan_vs_measured)."""
    return {
        "step_time_s": plan.step_time_s,
        "tokens_per_s": plan.expected_tokens_per_s,
        "peak_gpu_memory_gb": plan.per_gpu_memory_gb["total"],
        "peak_host_memory_gb_per_node": plan.host_memory_per_node_gb,
    }


def largest_host_term(plan: Plan) -> str:
    name, value = max(plan.host_memory_terms_gb.items(), key=lambda item: item[1])
    return f"{name} {value:.0f} GB"

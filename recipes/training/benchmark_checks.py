"""The in-loop benchmarks' settings from the recipe, and their checks before the model costs anything: numbers,
data directories, the hub offline, and the prompts' lengths against the model's positions."""

from __future__ import annotations

import logging

from common.collectives import on_every_rank, on_main_process
from eval.harness import BenchmarkSettings
from recipes.config import ConfigError, PretrainConfig

logger = logging.getLogger("pretrain")


# BenchmarkSettings' fields as the recipe names them, for its messages
RECIPE_KEYS = {"tasks": "eval_tasks", "limit": "eval_limit", "num_fewshot": "eval_num_fewshot",
               "batch_size": "per_device_eval_batch_size", "max_gen_toks": "eval_max_gen_toks",
               "mmlu_dir": "mmlu_dir"}  # fmt: skip


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
        log_samples=config.eval_log_samples,
    )


def check_benchmarks(config: PretrainConfig, tokenizer, positions: int, accelerator) -> BenchmarkSettings | None:
    """The recipe's benchmarks, checked (a collective; None: none configured)."""
    benchmarks = benchmark_settings(config)
    if not benchmarks:
        return None
    warnings: list[str] = []  # agreed: the offline check reads each node's own Hugging Face cache
    on_every_rank(lambda: warnings.extend(benchmarks.check(RECIPE_KEYS, positions)), catch=(ValueError,))
    for warning in warnings if accelerator.is_main_process else []:
        logger.warning(warning)
    logger.info("benchmarks: %s every %d evaluation(s)", ", ".join(benchmarks.tasks), config.eval_benchmarks_every)
    strict, trained = config.preflight_strict, config.max_seq_length if config.max_seq_length < positions else None
    on_main_process(lambda: check_prompt_lengths(benchmarks, tokenizer, positions, strict, trained),
                    catch=(ConfigError,))  # fmt: skip
    return benchmarks


def check_prompt_lengths(benchmarks: BenchmarkSettings, tokenizer, positions: int, strict: bool,
                         trained: int | None = None) -> None:  # fmt: skip
    """The configured benchmarks' prompts against the model's positions: a prompt longer than them is cut from the
    left by lm-eval, silently, for the whole run; refused under preflight_strict, else a warning. Prompts past the
    trained length (`trained`: max_seq_length, when shorter) are said at start: they run on untrained positions."""
    from eval.harness import measure_prompts

    lengths = measure_prompts(benchmarks, tokenizer, positions, trained)
    said, untrained = lengths.warning("benchmarks"), lengths.untrained_warning("benchmarks")
    if untrained:
        logger.warning("%s", untrained)
    if said is None:
        logger.info("benchmarks: %d prompts, the longest %d tokens, within max_position_embeddings %d",
                    lengths.prompts, lengths.longest_tokens, positions)  # fmt: skip
        return
    fix = (f"Raise model_config.max_position_embeddings to {positions + lengths.most_over} or more (RoPE has no "
           "weights: it costs no memory, but positions past max_seq_length are untrained), or lower "
           "eval_num_fewshot")  # fmt: skip
    if strict:
        raise ConfigError(f"{said}. {fix}; or set preflight_strict: false to score them cut")
    logger.warning("%s. %s", said, fix)

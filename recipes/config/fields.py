"""The recipe's fields: one typed key each, with its default and a one-line help, and the values some keys allow.

Keys follow Hugging Face `TrainingArguments` names wherever one exists.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A recipe value that cannot work; the message names the key and what would be valid."""


LR_SCHEDULER_TYPES = ("cosine_with_min_lr", "cosine", "constant_with_warmup")
# The attention implementations a recipe may ask for, each with the path that masks packed documents from each other
# (recipes.training.attention): a variable-length kernel (flash-attn's, or torch's own: recipes.training.torch_varlen),
# or a block-diagonal mask built from position ids (dense for sdpa and eager, a BlockMask for flex_attention).
ATTN_MASKING_PATHS = {"flash_attention_2": "varlen", "torch_varlen": "varlen", "sdpa": "block_mask",
                      "eager": "block_mask", "flex_attention": "block_mask"}  # fmt: skip
ATTN_IMPLEMENTATIONS = tuple(ATTN_MASKING_PATHS)
LOSS_SPIKE_ACTIONS = ("log", "rollback")
REPORT_TO = ("tensorboard", "wandb", "mlflow", "none")

# LlamaConfig keys a recipe may set under `model_config`; anything else is a typo, not a wish.
MODEL_CONFIG_KEYS: dict[str, type] = {
    "vocab_size": int,
    "hidden_size": int,
    "intermediate_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "max_position_embeddings": int,
    "rms_norm_eps": float,
    "rope_theta": float,
    "initializer_range": float,
    "tie_word_embeddings": bool,
    "hidden_act": str,
}
# The keys that size a from-scratch model: without one LlamaConfig would fill in its own default (a 7B shape) and a
# 70B recipe would train, and plan, another model without a word.
MODEL_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# The recipe's `hardware` block (and the planner's flags of the same names): the cluster, then the numbers of the
# wires that override a GPU profile's (recipes.planning.step_time).
WIRE_KEYS = ("intra_node_gb_s", "inter_node_gbps", "host_link_gb_s", "host_memory_gb_s", "compute_efficiency",
             "overlap")  # fmt: skip
HARDWARE_KEYS = ("gpus", "nodes", "gpu_memory_gb", "host_memory_gb", "mfu", "profile", "interconnect", *WIRE_KEYS)


@dataclass
class PretrainConfig:
    """One pretraining run. Field names follow `transformers.TrainingArguments` where one exists."""

    output_dir: str = field(metadata={"help": "Where metrics, checkpoints, `final/` and `loss.png` go."})
    tokenizer_name_or_path: str = field(
        metadata={"help": "Local tokenizer directory (or hub name when online); the model's vocabulary must cover it."}
    )
    train_files: list[str] | None = field(
        default=None,
        metadata={
            "help": (
                "Local jsonl / parquet / txt files (optionally .gz / .zst), a hub dataset name when online, or "
                "one directory written by `python -m data_prep.preprocess` (recognised by its manifest.json). "
                "Exclusive with train_mixture."
            )
        },
    )
    train_mixture: list[dict[str, Any]] | None = field(
        default=None,
        metadata={
            "help": (
                "Weighted preprocessed directories, [{path: DIR, weight: w}, ...], blended in exact proportions "
                "(set train_files: null)."
            )
        },
    )
    mixture_exhausted: str = field(
        default="repeat",
        metadata={"help": "When a train_mixture source runs out: repeat (its next epoch) or stop (end the run)."},
    )
    model_config: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "LlamaConfig values for a from-scratch model; `vocab_size` defaults to the tokenizer's size."
        },
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Continue from this local HF checkpoint instead of building `model_config` from scratch."},
    )
    validation_files: list[str] = field(
        default_factory=list, metadata={"help": "Held-out files for `eval_loss`; empty turns validation off."}
    )
    text_field: str = field(
        default="text", metadata={"help": "Field holding the document text in jsonl and parquet files."}
    )
    seed: int = field(default=42, metadata={"help": "Seed for model init and every rank's RNG."})
    shuffle_train_rows: bool = field(
        default=True,
        metadata={
            "help": (
                "Train a preprocessed directory's rows (each mixture source's) in a pseudo-random order, another "
                "each epoch, not in corpus order (the input files': one source after another). Raw text is read in "
                "file order."
            )
        },
    )
    data_seed: int | None = field(default=None, metadata={"help": "Seed of that order; null uses `seed`."})

    max_seq_length: int = field(
        default=2048,
        metadata={"help": "Tokens per packed row; every row is exactly this long (EOS between documents, no padding)."},
    )
    per_device_train_batch_size: int = field(
        default=2, metadata={"help": "Micro-batch: packed rows per GPU per forward pass."}
    )
    per_device_eval_batch_size: int = field(default=2, metadata={"help": "Rows per GPU per validation forward pass."})
    gradient_accumulation_steps: int = field(
        default=8, metadata={"help": "Micro-batches per optimizer step on each GPU."}
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={
            "help": (
                "Rows per optimizer step over all GPUs; when set, micro x accumulation x world size must equal it."
            )
        },
    )
    elastic: bool = field(
        default=False,
        metadata={
            "help": (
                "Continue on whatever number of processes a launch has (a node lost, or back): gradient_accumulation_"
                "steps is derived from global_batch_size for the launch's world size, and a checkpoint written by "
                "another number of ranks is converted to DeepSpeed's universal format at start, once. Needs "
                "global_batch_size and preprocessed train data (a raw-text position is per rank)."
            )
        },
    )

    learning_rate: float = field(
        default=1e-4, metadata={"help": "Peak AdamW learning rate, reached at the end of warmup."}
    )
    weight_decay: float = field(
        default=0.1, metadata={"help": "AdamW decoupled weight decay; never applied to norms or biases."}
    )
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Gradient clipping by global norm (DeepSpeed `gradient_clipping`)."}
    )
    lr_scheduler_type: str = field(
        default="cosine_with_min_lr", metadata={"help": "One of cosine_with_min_lr, cosine, constant_with_warmup."}
    )
    lr_scheduler_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Extra schedule values; cosine_with_min_lr needs `min_lr`."}
    )
    warmup_steps: int = field(
        default=0, metadata={"help": "Optimizer steps of linear warmup from 0 to `learning_rate`."}
    )

    num_train_epochs: int = field(
        default=1,
        metadata={"help": "Passes over `train_files`; training stops at `max_steps` or when the last pass ends."},
    )
    max_steps: int = field(
        default=-1,
        metadata={"help": "Optimizer steps; -1 derives them from `total_tokens` / (global batch x max_seq_length)."},
    )
    total_tokens: int | None = field(
        default=None, metadata={"help": "Token budget of the run; used when `max_steps` is -1."}
    )

    bf16: bool = field(default=True, metadata={"help": "bf16 mixed precision (DeepSpeed `bf16.enabled`)."})
    fp16: bool = field(default=False, metadata={"help": "fp16 mixed precision with loss scaling; exclusive with bf16."})
    document_masking: bool = field(
        default=False,
        metadata={
            "help": (
                "No attention across EOS inside a packed row: position ids restart after every EOS, and each "
                "attention path masks per document at any micro-batch (flash_attention_2: varlen kernel with "
                "cumulative lengths the recipe passes; sdpa and eager: a block-diagonal mask). The run's first "
                "lines say which path it took."
            )
        },
    )
    attn_implementation: str = field(
        default="flash_attention_2",
        metadata={"help": "Requested attention; falls back to sdpa where its kernel or CUDA is missing, and says so."},
    )
    gradient_checkpointing: bool = field(
        default=True, metadata={"help": "Recompute activations in the backward pass instead of storing them."}
    )
    gradient_checkpointing_layers_per_checkpoint: int = field(
        default=1, metadata={"help": "Decoder layers recomputed together: N stores one hidden state every N layers."}
    )
    zero3_leaf_modules: list[str] = field(
        default_factory=lambda: ["LlamaDecoderLayer"],
        metadata={
            "help": (
                "Module classes ZeRO-3 gathers whole, with no hooks on the modules inside them (DeepSpeed's leaf "
                "modules): one fetch and release per decoder layer instead of ~13. [] hooks every module."
            )
        },
    )

    logging_steps: int = field(
        default=10, metadata={"help": "Optimizer steps between metric lines (console, metrics.jsonl, TensorBoard)."}
    )
    eval_steps: int = field(default=1000, metadata={"help": "Optimizer steps between validation-loss evaluations."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Cap on packed validation rows per evaluation (all of them when unset)."}
    )
    save_steps: int = field(default=1000, metadata={"help": "Optimizer steps between checkpoints."})
    save_total_limit: int | None = field(
        default=None,
        metadata={"help": "Checkpoints kept on disk (oldest deleted after a new one is complete); unset keeps all."},
    )
    early_stopping_patience: int | None = field(
        default=None,
        metadata={"help": "Stop after this many evaluations without an eval_loss improvement; unset disables it."},
    )
    early_stopping_threshold: float = field(
        default=0.0,
        metadata={"help": "Minimum eval_loss decrease that resets the patience count (the best is any lower loss)."},
    )
    loss_spike_factor: float | None = field(
        default=None,
        metadata={
            "help": (
                "A step whose loss (mean over ranks) exceeds this x the mean of the previous `loss_spike_window` "
                "steps is a spike; unset turns the rule off."
            )
        },
    )
    loss_spike_window: int = field(
        default=100, metadata={"help": "Steps in the running mean the spike rule compares against."}
    )
    loss_spike_action: str = field(
        default="log",
        metadata={
            "help": (
                "log: record the spike and go on; rollback: reload the last checkpoint and continue with the data"
                " after the spike, skipping the window between."
            )
        },
    )
    loss_spike_max_rollbacks: int = field(
        default=3,
        metadata={
            "help": (
                "Rollbacks over the whole run, every launch, before the rule only logs (spikes that keep coming back "
                "need a person, not more rollbacks)."
            )
        },
    )
    eval_tasks: list[str] = field(
        default_factory=list,
        metadata={"help": "Benchmarks run through lm-eval at evaluations: mmlu, gsm8k; empty turns them off."},
    )
    eval_limit: int | None = field(
        default=None, metadata={"help": "Documents per benchmark task (per MMLU subject); unset runs all of them."}
    )
    eval_benchmarks_every: int = field(
        default=1,
        metadata={
            "help": "Run the benchmarks at every k-th evaluation (and at the last step); eval_loss runs at every one."
        },
    )
    eval_num_fewshot: int = field(
        default=5,
        metadata={
            "help": "Few-shot examples per prompt (lm-eval's `num_fewshot`; the SPEC's MMLU and GSM8K are 5-shot)."
        },
    )
    eval_max_gen_toks: int | None = field(
        default=None, metadata={"help": "GSM8K answer budget in tokens; unset keeps lm-eval's 256."}
    )
    eval_log_samples: bool = field(
        default=False,
        metadata={"help": "Write every benchmark document's prompt, answers and scores to eval/step-N-samples.jsonl."},
    )
    mmlu_dir: str | None = field(
        default=None,
        metadata={
            "help": "Local MMLU: the release layout (test/, dev/ csv) or a cais/mmlu snapshot; unset reads the hub."
        },
    )
    gsm8k_dir: str | None = field(
        default=None,
        metadata={
            "help": (
                "Local GSM8K: the release (test.jsonl, train.jsonl) or an openai/gsm8k snapshot; unset reads the hub."
            )
        },
    )

    dataloader_num_workers: int = field(default=0, metadata={"help": "Dataloader worker processes per GPU."})
    dataloader_pin_memory: bool = field(
        default=True, metadata={"help": "Pin host memory of batches (only takes effect with CUDA)."}
    )
    peak_tflops_per_device: float | None = field(
        default=312.0, metadata={"help": "Dense bf16 peak per device for MFU (A100/A800: 312); unset logs no MFU."}
    )
    hardware: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "What `recipes.plan` assumes: gpus, nodes, gpu_memory_gb, host_memory_gb (per node), "
            "profile (a800-pcie, a800-sxm, a100-pcie, a100-sxm, h100-sxm, h200-sxm), interconnect "
            "(ib100..ib800), overrides of the profile's bandwidths, or a fixed mfu."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": (
                "With resume_from_checkpoint none, delete the previous run's checkpoints and outputs in output_dir "
                "first; without it such a start is refused."
            )
        },
    )
    hang_timeout_s: float | None = field(
        default=1800.0,
        metadata={
            "help": (
                "A rank with no forward pass, optimizer step or save for this long dumps every thread's stack and "
                "exits 1 (so a requeue relaunches the run); also the dataloader's timeout. Unset turns it off."
            )
        },
    )
    resume_from_checkpoint: str = field(
        default="auto",
        metadata={
            "help": (
                "auto: the newest complete checkpoint in output_dir, if any; none: start fresh; or a checkpoint path."
            )
        },
    )
    report_to: list[str] = field(
        default_factory=lambda: ["tensorboard"],
        metadata={
            "help": (
                "Experiment trackers, through accelerate: tensorboard, wandb, mlflow (any of them), or none. "
                "metrics.jsonl is always written."
            )
        },
    )
    prometheus_port: int | None = field(
        default=None,
        metadata={
            "help": (
                "Serve the run's metrics for Prometheus on this port of every node's local rank 0 (e.g. 9555; not "
                "9400, dcgm-exporter's); unset serves nothing."
            )
        },
    )
    metrics_host: str = field(
        default="127.0.0.1",
        metadata={
            "help": (
                "Address the metrics endpoint binds: this host only by default; 0.0.0.0 (what the Slurm scripts set) "
                "lets a Prometheus on another machine scrape it."
            )
        },
    )
    metrics_linger_s: float = field(
        default=35.0,
        metadata={
            "help": (
                "Seconds the metrics endpoint stays up after the run ends, serving its exit code "
                "(pretrain_run_exit_code), so that Prometheus tells a run that ended from one that died: at least one "
                "scrape_interval (30 s in monitoring/README.md). Only with prometheus_port."
            )
        },
    )
    preflight_strict: bool = field(
        default=True,
        metadata={
            "help": (
                "Stop at start-up when the plan says the run does not fit in GPU or host memory, or when a benchmark "
                "prompt is longer than max_position_embeddings (lm-eval would cut it); false: a warning instead."
            )
        },
    )

    def micro_tokens(self) -> int:
        return self.per_device_train_batch_size * self.max_seq_length

    @property
    def resolved_data_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    def resolved_global_batch_size(self, world_size: int) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * world_size

    def total_steps(self, world_size: int) -> int:
        """Optimizer steps of the run: `max_steps`, or the token budget divided by tokens per step."""
        if self.max_steps > 0:
            return self.max_steps
        tokens_per_step = self.resolved_global_batch_size(world_size) * self.max_seq_length
        return self.total_tokens // tokens_per_step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def field_types() -> dict[str, Any]:
    return typing.get_type_hints(PretrainConfig)

"""What one in-loop benchmark evaluation costs under ZeRO-3: forward passes, seconds, share of training time.

Under ZeRO-3 every forward pass gathers the whole model's bf16 weights from all ranks, evaluation included, and
generation runs one forward per generated token. lm-eval scores an MMLU document in one forward (its four one-token
answers share the context: `group_by="contexts"` with the logits cache), so a loglikelihood batch of b rows scores
b documents. A GSM8K batch of b documents is one `generate` call: a prefill and up to `max_gen_toks` one-token
forwards (a model that does not stop early runs all of them; the priced case). A forward costs the gather (from the
same wire model as training, `step_time.collective_s`) plus the longer of its compute (2·N FLOPs per token, at the
training compute efficiency) and ZeRO-3's host work for one pass (`step_time.host_s_per_pass`).

Prompt lengths are estimates for the SPEC's 5-shot prompts with a Llama-2-sized vocabulary (about 110 tokens per
MMLU example and 160 per GSM8K example, question and answer): they set the compute term, which is small next to the
gathers at 70B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MMLU_TEST_DOCUMENTS = 14_042  # 57 subjects
MMLU_SUBJECTS = 57
GSM8K_TEST_DOCUMENTS = 1_319
MMLU_TOKENS_PER_EXAMPLE = 110
GSM8K_TOKENS_PER_EXAMPLE = 160
LM_EVAL_MAX_GEN_TOKS = 256  # lm-eval's default generation budget for GSM8K
SHARE_WARNING = 0.10  # preflight warns when benchmarks take more than this share of the training time


@dataclass(frozen=True)
class EvalWork:
    """What one evaluation asks for, per the recipe."""

    tasks: tuple[str, ...]
    limit: int | None  # documents per task (per MMLU subject); None: all
    num_fewshot: int
    batch_size: int  # rows per forward per rank
    max_gen_toks: int | None  # None: lm-eval's 256
    ranks_sharing: int  # ranks the documents are split over (1: every rank runs every request)
    mmlu_subjects: int = MMLU_SUBJECTS  # fewer where a local MMLU directory holds fewer

    def documents(self) -> dict[str, int]:
        counts = {}
        if "mmlu" in self.tasks:
            everything = round(MMLU_TEST_DOCUMENTS * self.mmlu_subjects / MMLU_SUBJECTS)
            counts["mmlu"] = min(everything, self.limit * self.mmlu_subjects) if self.limit else everything
        if "gsm8k" in self.tasks:
            counts["gsm8k"] = min(GSM8K_TEST_DOCUMENTS, self.limit) if self.limit else GSM8K_TEST_DOCUMENTS
        return counts


@dataclass(frozen=True)
class EvalCost:
    documents: dict[str, int]  # per task, over all ranks
    forward_passes: int  # per rank, every one a full gather of the weights
    seconds: float
    seconds_by_task: dict[str, float]
    share: float | None  # of the training time between two benchmark evaluations

    def seconds_per_document(self, task: str) -> float:
        return self.seconds_by_task[task] / self.documents[task]


def forward_passes(work: EvalWork) -> dict[str, int]:
    """Forward passes per rank and task."""
    passes = {}
    for task, documents in work.documents().items():
        per_rank = math.ceil(documents / work.ranks_sharing)
        if task == "mmlu" and work.limit:  # dealt out subject by subject: a rank scores at least one of each
            per_rank = work.mmlu_subjects * math.ceil(documents / work.mmlu_subjects / work.ranks_sharing)
        batches = math.ceil(per_rank / work.batch_size)
        generated = (work.max_gen_toks or LM_EVAL_MAX_GEN_TOKS) if task == "gsm8k" else 0
        passes[task] = batches * (1 + generated)
    return passes


def eval_cost(work: EvalWork, *, params: int, gather_s: float, flops_per_s: float, host_s_per_forward: float = 0.0,
              training_s_between: float | None) -> EvalCost:  # fmt: skip
    """Seconds per evaluation: every forward gathers the weights (`gather_s`, 0 on one GPU), then takes the longer of
    its compute (2·N FLOPs per token at `flops_per_s`) and the host's `host_s_per_forward`. `training_s_between`:
    training time between two benchmark evaluations, for the share."""
    passes = forward_passes(work)
    seconds_by_task = {}
    for task, count in passes.items():
        per_example = MMLU_TOKENS_PER_EXAMPLE if task == "mmlu" else GSM8K_TOKENS_PER_EXAMPLE
        prompt_tokens = per_example * (work.num_fewshot + 1)
        batches = count if task == "mmlu" else count // (1 + (work.max_gen_toks or LM_EVAL_MAX_GEN_TOKS))
        prefill_s = 2.0 * params * work.batch_size * prompt_tokens / flops_per_s
        decode_s = 2.0 * params * work.batch_size / flops_per_s
        forwards_s = batches * max(prefill_s, host_s_per_forward) + (count - batches) * max(
            decode_s, host_s_per_forward
        )
        seconds_by_task[task] = count * gather_s + forwards_s
    seconds = sum(seconds_by_task.values())
    share = seconds / training_s_between if training_s_between else None
    return EvalCost(work.documents(), sum(passes.values()), seconds, seconds_by_task, share)


def wall_days(days: float | None, eval_share: float | None, saves: int, save_s: float) -> float | None:
    """The run's days with the in-loop benchmarks (their share of the training between two evaluations) and the
    minutes of each checkpoint save; None without a time."""
    if days is None:
        return None
    return days * (1 + (eval_share or 0)) + saves * save_s / 86_400

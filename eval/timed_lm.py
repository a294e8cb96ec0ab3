"""lm-eval's HF model as the evaluations here run it (`TimedLM`), and what it counts of the prompts
(`PromptLengths`)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

from eval.agreement import EvaluationStopped, stopping_on_signal

# Training tokenizes with add_special_tokens=False and separates documents by EOS only: the model never saw a BOS
# token, so a benchmark prompt gets none either (lm-eval's HF model would add the tokenizer's, a Llama tokenizer's
# <s>), and the prompts are measured before the run (`eval.harness.measure_prompts`) the same way.
ADD_BOS_TOKEN = False


@dataclass
class PromptLengths:
    """Benchmark prompts against the model's positions: lm-eval cuts a longer one from the left, without failing, so
    the score is then on a prompt the model never saw whole. A scoring prompt (MMLU's) may hold `max_length` + 1
    tokens (the last is predicted, not fed); a generation's context leaves room for its `max_gen_toks`."""

    max_length: int
    prompts: int = 0
    truncated: int = 0
    longest_tokens: int = 0  # of any prompt, counted as lm-eval's HF model counts it
    most_over: int = 0  # the most tokens any prompt holds beyond what it may: positions to add so none is cut
    # the rows the model was trained on (max_seq_length), when shorter than its positions: prompts past it are not
    # cut, but run at positions training never reached (the 70B recipes: 2,048 of 4,096; 5-shot MMLU reaches ~2.9k)
    trained_length: int | None = None
    beyond_trained: int = 0

    def add(self, tokens: int, allowed: int) -> None:
        self.prompts += 1
        self.truncated += tokens > allowed
        self.longest_tokens = max(self.longest_tokens, tokens)
        self.most_over = max(self.most_over, tokens - allowed)
        if self.trained_length is not None:
            self.beyond_trained += tokens > allowed - (self.max_length - self.trained_length)

    def summed_over_ranks(self, device) -> PromptLengths:
        """Every rank's counts together (a collective: every rank calls it)."""
        import torch
        import torch.distributed as dist

        counts = torch.tensor([self.prompts, self.truncated], dtype=torch.int64, device=device)
        largest = torch.tensor([self.longest_tokens, self.most_over], dtype=torch.int64, device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return PromptLengths(self.max_length, *(int(value) for value in (*counts, *largest)))

    def untrained_warning(self, where: str) -> str | None:
        """The line that says prompts reach past the trained length (None: none does, or it was not asked)."""
        if not self.beyond_trained:
            return None
        return (
            f"{where}: {self.beyond_trained:,} of {self.prompts:,} benchmark prompts run past max_seq_length "
            f"{self.trained_length:,} (the longest holds {self.longest_tokens:,} tokens): their last tokens sit at "
            "positions training never reached, and their scores say how the model extrapolates; lower "
            "eval_num_fewshot to keep them within it"
        )

    def warning(self, where: str) -> str | None:
        """The line that says prompts were cut (None: none was)."""
        if not self.truncated:
            return None
        return (
            f"{where}: {self.truncated:,} of {self.prompts:,} benchmark prompts are longer than the model's "
            f"{self.max_length:,} positions (max_position_embeddings; the longest holds {self.longest_tokens:,} "
            "tokens), and lm-eval cuts them from the left: their scores are on prompts the model never sees whole"
        )


class TimedLM:
    """Mixed into lm-eval's HFLM (`timed_lm_class`): times its two request types, `loglikelihood_s` (MMLU's scoring)
    and `generate_until_s` (GSM8K's answers), with the number of requests of each; counts the prompts' lengths; and
    asks `stop_requested` before every forward pass and generation, so that a stop signal ends an evaluation within
    one of them (`EvaluationStopped`)."""

    def __init__(self, *args, stop_requested=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop_requested = stop_requested
        self.timings = {"loglikelihood_s": 0.0, "loglikelihood_requests": 0, "generate_until_s": 0.0,
                        "generate_until_requests": 0}  # fmt: skip
        self.prompt_lengths = PromptLengths(self.max_length)

    def _loglikelihood_tokens(self, requests, *args, **kwargs):
        for _, context, continuation in requests:  # what HFLM cuts: beyond max_length + 1 tokens
            self.prompt_lengths.add(len(context) + len(continuation), self.max_length + 1)
        return super()._loglikelihood_tokens(requests, *args, **kwargs)

    def _agreed(self, flag: bool) -> bool:
        return flag  # one process: its own answer (the sharded LM asks every rank)

    def _stop_if_requested(self) -> None:
        # asked (and, sharded, agreed on) before every forward pass even without `stop_requested`: the agreement is
        # also where a rank that failed meets the others, instead of them meeting it in ZeRO-3's next weight gather
        asked = self.stop_requested is not None and bool(self.stop_requested())
        if self._agreed(asked):
            raise EvaluationStopped("a stop signal arrived during the evaluation")

    def _model_call(self, *args, **kwargs):
        self._stop_if_requested()
        return super()._model_call(*args, **kwargs)

    def _model_generate(self, *args, **kwargs):
        self._stop_if_requested()
        if self.stop_requested is None:
            return super()._model_generate(*args, **kwargs)
        with stopping_on_signal(self.stop_requested):
            generated = super()._model_generate(*args, **kwargs)
        self._stop_if_requested()  # a cut answer is never scored: every rank stops here
        return generated

    def _timed(self, kind: str, method, requests, **kwargs):
        started = time.perf_counter()
        try:
            return method(requests, **kwargs)
        finally:
            self.timings[f"{kind}_s"] += time.perf_counter() - started
            self.timings[f"{kind}_requests"] += len(requests)

    def loglikelihood(self, requests, **kwargs):
        return self._timed("loglikelihood", super().loglikelihood, requests, **kwargs)

    def generate_until(self, requests, **kwargs):
        from lm_eval.models.utils import normalize_gen_kwargs

        for request in requests:  # what HFLM cuts: a context beyond max_length - max_gen_toks
            context, gen_kwargs = request.args
            budget = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)["max_gen_toks"]
            self.prompt_lengths.add(len(self.tok_encode(context)), self.max_length - budget)
        return self._timed("generate_until", super().generate_until, requests, **kwargs)


@functools.cache
def timed_lm_class():
    """lm-eval's HFLM with `TimedLM`."""
    from lm_eval.models.huggingface import HFLM

    return type("TimedHFLM", (TimedLM, HFLM), {})

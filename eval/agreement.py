"""What the ranks of an evaluation agree on before each collective and forward pass: whether a rank failed (then every
rank leaves lm-eval together, `eval.sharded`) or has a stop signal (then every rank stops at the same forward pass)."""

from __future__ import annotations

import contextlib

# A rank's state at each agreement (the largest wins)
RUNNING, STOPPING, FAILED = 0, 1, 2


class FailedOnAnotherRank(Exception):
    """Another rank's evaluation raised; this rank left lm-eval at the next collective instead of waiting for it."""


class EvaluationStopped(Exception):
    """A stop signal ended an evaluation: raised on every rank at the same forward pass, so that they leave lm-eval
    together and the run saves."""


def most_on_any_rank(count: int, device) -> int:
    """The largest `count` of any rank (a collective)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


class StopOnSignal:
    """A transformers stopping criterion: every sequence is done once `stop_requested()` is true."""

    def __init__(self, stop_requested):
        self.stop_requested = stop_requested

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        return torch.full((input_ids.shape[0],), bool(self.stop_requested()), dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def stopping_on_signal(stop_requested):
    """While active, lm-eval's generations also end at the next token once `stop_requested()` is true: its
    stop-sequence criteria get `StopOnSignal` beside them (a generation of hundreds of tokens, each a gathered forward
    pass at 70B, would otherwise run to its end)."""
    from lm_eval.models import huggingface

    stop_sequences_criteria = huggingface.stop_sequences_criteria

    def with_stop_signal(*args, **kwargs):
        criteria = stop_sequences_criteria(*args, **kwargs)
        criteria.append(StopOnSignal(stop_requested))
        return criteria

    huggingface.stop_sequences_criteria = with_stop_signal
    try:
        yield
    finally:
        huggingface.stop_sequences_criteria = stop_sequences_criteria

"""Validation loss on held-out packed rows, computed on every rank.

Under ZeRO-3 every forward pass gathers parameters from all ranks, so every rank must run the
same number of forward passes. Rows are dealt round-robin; a rank short of a full batch runs a
filler batch whose tokens carry weight 0.
"""

from __future__ import annotations

import itertools
import math

import torch

from data_prep.packing.stream import PackedTextStream
from recipes.training.attention import DocumentMasking


def load_validation_rows(sources, tokenizer, seq_len: int, text_field: str, max_rows: int | None) -> torch.Tensor:
    """All validation rows, identical on every rank (each rank reads the files itself)."""
    stream = PackedTextStream(sources, tokenizer, seq_len, text_field=text_field)
    rows = [item["input_ids"] for item in itertools.islice(iter(stream), max_rows)]
    if not rows:
        raise ValueError(
            f"validation_files {sources} yield no full row of {seq_len} tokens; add text or lower max_seq_length"
        )
    return torch.stack(rows)


def rows_sha256(rows: torch.Tensor) -> str:
    """The validation set's identity: the exact tokens evaluated (files, tokenizer, row length and max_eval_samples
    all change it). Losses on two sets are not comparable, so the best loss is kept per set."""
    import hashlib

    return hashlib.sha256(rows.to(torch.int64).numpy().tobytes()).hexdigest()


def rank_batches(rows: torch.Tensor, rank: int, world_size: int, batch_size: int):
    """This rank's batches as (input_ids, weight) pairs; every rank gets the same number of batches."""
    mine = rows[rank::world_size]
    num_batches = math.ceil(math.ceil(len(rows) / world_size) / batch_size)
    for index in range(num_batches):
        batch = mine[index * batch_size : (index + 1) * batch_size]
        if len(batch) == 0:
            yield rows[:1], 0.0
        else:
            yield batch, 1.0


@torch.no_grad()
def validation_loss(
    model, accelerator, rows: torch.Tensor, batch_size: int, masking: DocumentMasking | None = None
) -> float:
    """Mean next-token cross-entropy over all validation tokens, the same value on every rank; documents are
    masked from each other as in training (`masking`, the training loop's)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for batch, weight in rank_batches(rows, accelerator.process_index, accelerator.num_processes, batch_size):
        batch = batch.to(accelerator.device)
        inputs = masking.inputs(batch) if masking is not None else {}
        loss = model(input_ids=batch, labels=batch, **inputs).loss.double()
        predicted_tokens = batch.shape[0] * (batch.shape[1] - 1)
        totals[0] += loss * predicted_tokens * weight
        totals[1] += predicted_tokens * weight
    totals = accelerator.reduce(totals, reduction="sum")
    if was_training:
        model.train()
    return (totals[0] / totals[1]).item()

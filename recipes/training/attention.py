"""Document masking on every attention path: what the model is given so that a packed row's documents do not see
each other, and which of transformers' paths that takes.

Packed rows hold several documents separated by EOS. With `document_masking`, position ids restart after every EOS,
and transformers turns them into per-document attention in one of two ways:
- `sdpa` and `eager` build their mask from the position ids (`find_packed_sequence_indices` in
  `transformers.masking_utils`): a block-diagonal causal mask, per row, at any micro-batch size (`block_mask`);
- `flash_attention_2` has no mask: it runs flash-attn's variable-length kernel over cumulative sequence lengths
  (`varlen`). transformers infers them from the position ids only for a batch of one row (`_is_packed_sequence`);
  with a micro-batch of 2 it would silently run the dense causal kernel across documents. So the recipe computes
  `cu_seq_lens_q/k` and `max_length_q/k` once per micro-batch, with transformers' own
  `prepare_fa_kwargs_from_position_ids`, and passes them: its varlen branch then treats the B rows as B x S tokens
  of one flattened sequence. Every row starts a new sequence (positions restart at each row's first token), so no
  token attends across a row boundary, and labels stay per row, so no token is predicted from the previous row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recipes.config import ATTN_MASKING_PATHS as MASKING_PATHS


def masking_path(attn_implementation: str, document_masking: bool) -> str:
    """`varlen`, `block_mask` or `none` (document masking off). Raises ValueError for an implementation that has no
    packed path: training would silently attend across documents."""
    if not document_masking:
        return "none"
    if attn_implementation not in MASKING_PATHS:
        raise ValueError(
            f"document_masking: true needs an attention implementation that masks packed documents "
            f"({', '.join(MASKING_PATHS)}); {attn_implementation!r} has no packed path"
        )
    return MASKING_PATHS[attn_implementation]


def describe(attn_implementation: str, document_masking: bool) -> str:
    """The start-of-run line: `attention: flash_attention_2, document masking: on (varlen)`."""
    path = masking_path(attn_implementation, document_masking)
    state = f"on ({path})" if document_masking else "off"
    return f"attention: {attn_implementation}, document masking: {state}"


def document_inputs(input_ids, eos_id: int | None, attn_implementation: str) -> dict[str, Any]:
    """Keyword arguments for the model's forward that mask the documents of a packed [batch, seq] micro-batch from
    each other; {} when `eos_id` is None (document masking off). A `flash_attention_2` batch gets the varlen
    arguments (one host sync per micro-batch for the integer max length, not one per layer)."""
    if eos_id is None:
        return {}
    from data_prep.packing.rows import document_position_ids

    position_ids = document_position_ids(input_ids, eos_id)
    if masking_path(attn_implementation, True) != "varlen":
        return {"position_ids": position_ids}
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    (cu_seq_lens_q, cu_seq_lens_k), (max_length_q, max_length_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    return {
        "position_ids": position_ids,
        "cu_seq_lens_q": cu_seq_lens_q,
        "cu_seq_lens_k": cu_seq_lens_k,
        "max_length_q": int(max_length_q),  # flash-attn takes Python ints
        "max_length_k": int(max_length_k),
    }


@dataclass(frozen=True)
class DocumentMasking:
    """How a run's forwards mask packed documents: `eos_id` None means off. Training and validation share one."""

    eos_id: int | None
    attn_implementation: str

    @classmethod
    def of(cls, document_masking: bool, eos_id: int, attn_implementation: str) -> DocumentMasking:
        masking_path(attn_implementation, document_masking)  # refuses an implementation without a packed path
        return cls(eos_id if document_masking else None, attn_implementation)

    @property
    def path(self) -> str:
        return masking_path(self.attn_implementation, self.eos_id is not None)

    def inputs(self, input_ids) -> dict[str, Any]:
        return document_inputs(input_ids, self.eos_id, self.attn_implementation)

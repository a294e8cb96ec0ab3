"""Packing: documents' token ids into rows of exactly `seq_len`, EOS after every document.

Pure functions over token lists; readers and writers wrap them. The carry-over buffer means a
document may span two rows, and no row is ever padded. What is left at the end of the stream
(fewer than `seq_len` tokens) is dropped: at most `seq_len - 1` tokens per stream, and keeping
it would need padding, which would make the loss and the token counts lie.
"""

from collections.abc import Iterable, Iterator


def pack_documents(documents: Iterable[list[int]], seq_len: int, eos_id: int) -> Iterator[list[int]]:
    """Yield rows of exactly `seq_len` ids from documents, each followed by `eos_id`."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    buffer: list[int] = []
    for ids in documents:
        buffer.extend(ids)
        buffer.append(eos_id)
        if len(buffer) >= seq_len:
            full = len(buffer) - len(buffer) % seq_len
            for start in range(0, full, seq_len):
                yield buffer[start : start + seq_len]
            del buffer[:full]


def dropped_tail_tokens(total_tokens_with_eos: int, seq_len: int) -> int:
    """Tokens left in the final, partial row that `pack_documents` drops."""
    return total_tokens_with_eos % seq_len


def document_position_ids(input_ids, eos_id: int):
    """Position ids that restart at 0 after every EOS, per row of a [batch, seq] LongTensor. Given to
    HF Llama without an attention mask, they make each document attend only to itself."""
    import torch

    seq_len = input_ids.shape[-1]
    positions = torch.arange(seq_len, device=input_ids.device).expand_as(input_ids)
    # A document starts at 0 and after each EOS; its first index, carried forward, is subtracted.
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = input_ids[..., :-1] == eos_id
    first_index = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=-1).values
    return positions - first_index

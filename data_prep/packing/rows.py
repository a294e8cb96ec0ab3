"""Packing: documents' token ids into rows of exactly `seq_len`, EOS after every document.

Pure functions over token lists (and arrays, for the stream); readers and writers wrap them. The carry-over buffer
means a document may span two rows, and no row is ever padded. What is left at the end of the stream (fewer than
`seq_len` tokens) is dropped: at most `seq_len - 1` tokens per stream, and keeping it would need padding, which would
make the loss and the token counts lie.
"""

from collections.abc import Iterable, Iterator

import numpy as np

# Longer documents are tokenized in pieces: a fast tokenizer needs ~145 bytes per character of one call's text
# (a 50 MB document took 7.1 GB whole), so a piece of 1M characters costs ~145 MB.
MAX_DOCUMENT_CHARS = 1_000_000


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


def pack_arrays(documents: Iterable[np.ndarray], seq_len: int, eos_id: int) -> Iterator[np.ndarray]:
    """`pack_documents` over int64 arrays of ids: the same rows, each an int64 array of its own. The stream's packer:
    documents are joined once per row boundary they reach, not token by token through a Python list."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    eos = np.array([eos_id], dtype=np.int64)
    pending: list[np.ndarray] = []
    pending_tokens = 0
    for ids in documents:
        pending += (ids, eos)
        pending_tokens += len(ids) + 1
        if pending_tokens >= seq_len:
            joined = np.concatenate(pending, dtype=np.int64)
            full = pending_tokens - pending_tokens % seq_len
            for start in range(0, full, seq_len):
                yield joined[start : start + seq_len].copy()  # its own memory: a worker sends one row, not the block
            pending, pending_tokens = [joined[full:].copy()], pending_tokens - full  # not a view holding the block


def split_text(text: str, max_chars: int) -> list[str]:
    """`text` in pieces of at most `max_chars` characters, each cut just before the last whitespace character of a
    run (the one a word follows), as late in the piece as there is one; at the limit only in a piece without any.
    Pre-tokenizers that split at whitespace (GPT-2's byte-level regex, SentencePiece's metaspace) then give the same
    ids for the pieces, concatenated, as for the whole text (a cut inside a run of spaces would not: the run's
    tokens change), while the tokenizer's memory is bounded by one piece. Joining the pieces gives `text` back."""
    if len(text) <= max_chars:
        return [text]
    pieces, start = [], 0
    while len(text) - start > max_chars:
        end = start + max_chars
        cut = next((i for i in range(end, start, -1) if text[i].isspace() and not text[i + 1 : i + 2].isspace()), end)
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def dropped_tail_tokens(total_tokens_with_eos: int, seq_len: int) -> int:
    """Tokens left in the final, partial row that `pack_documents` (and `pack_arrays`) drops."""
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

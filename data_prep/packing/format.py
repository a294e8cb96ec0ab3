"""The on-disk format of a preprocessed directory, shared by the writer (`preprocess`) and the readers
(`packed_dataset`, training): names, token dtype, and the tokenizer identity both sides compare."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from data_prep.tokenizer.loading import plain_backend

FORMAT_VERSION = 1
SHARD_DIR = "data"
MANIFEST = "manifest.json"  # written last: its presence means the directory is complete
# How a special token's string inside a document is tokenized (as text: only the EOS packing appends is special),
# recorded in a manifest and a preprocessing's progress under this key
SPECIAL_TOKENS_IN_TEXT = ("special_tokens_in_text", "text")
EXAMPLES_PER_REASON = 5  # file:line examples a manifest keeps for each kind of skipped record


def shard_name(index: int) -> str:
    return f"{SHARD_DIR}/train-{index:05d}.parquet"


def is_shard_file(name: str) -> bool:
    """A name in `data/` that this package writes (a shard, or one being written): the only files a resumed or
    restarted preprocessing or merge removes there. The hub's `train-00000-of-00002.parquet` is not one."""
    return re.fullmatch(r"train-\d{5,}\.(parquet|tmp)", name) is not None  # past 99,999: six digits


def is_preprocessed(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def tokenizer_identity(tokenizer, name: str) -> dict:
    """Name and a content hash of a fast tokenizer: its full serialization (vocabulary, merges, normalizer,
    pre-tokenizer, added tokens; not the truncation and padding settings, which no token id of ours depends on) plus
    EOS, so a copy in another directory has the same identity."""
    serialized = plain_backend(tokenizer).to_str()  # a call through transformers turns truncation off in place
    digest = hashlib.sha256(serialized.encode("utf-8"))
    digest.update(f"eos={tokenizer.eos_token_id}".encode())
    return {
        "name": str(name),
        "sha256": digest.hexdigest(),
        "vocab_size": len(tokenizer),
        "eos_id": tokenizer.eos_token_id,
    }

"""Loading a tokenizer by directory (or hub name) with an error that says what is wrong: a missing directory, or
one without tokenizer files, used to surface as transformers' "install sentencepiece" or a repo-id complaint."""

from __future__ import annotations

from pathlib import Path

from common.files import under_a_local_directory

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "tokenizer_config.json")


class TokenizerLoadError(ValueError):
    """The tokenizer named by a flag or key cannot be loaded; the message names it and what would be valid."""


def looks_local(name_or_path: str) -> bool:
    """A path rather than a hub name: it exists, it is written like a path (a hub name is `org/name`), or its first
    part is a directory here (`outputs/tokenizr`, mistyped, was asked of the hub for a minute, and loaded whatever
    repository has that name where one does)."""
    return (
        Path(name_or_path).exists()
        or name_or_path.startswith(("/", ".", "~"))
        or name_or_path.count("/") != 1
        or under_a_local_directory(name_or_path)
    )


def load_tokenizer(name_or_path: str, what: str):
    """`AutoTokenizer.from_pretrained`, after checking that a local directory holds a tokenizer. `what` names
    the flag or key in messages (`tokenizer_name_or_path`, `--tokenizer`)."""
    path = Path(name_or_path).expanduser()
    if looks_local(str(name_or_path)):
        if not path.is_dir():
            raise TokenizerLoadError(f"{what} {name_or_path}: no such directory")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise TokenizerLoadError(
                f"{what} {name_or_path} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}): point it at a "
                "tokenizer directory (python -m data_prep.train_tokenizer writes one; so does save_pretrained)"
            )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path) if looks_local(str(name_or_path)) else name_or_path)
    except (OSError, ValueError, ImportError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TokenizerLoadError(f"{what} {name_or_path}: cannot load it ({first_line})") from None


def plain_backend(tokenizer):
    """The Rust tokenizer under a fast tokenizer, without the truncation and padding its tokenizer.json may carry.
    transformers turns both off on every call it makes without them; the backend called directly does not, and cut
    every document at the saved length (and padded short ones) without a word. A copy where either is set: the
    caller's tokenizer stays as it was."""
    backend = tokenizer.backend_tokenizer
    if backend.truncation is None and backend.padding is None:
        return backend
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(backend.to_str())
    plain.no_truncation()
    plain.no_padding()
    return plain


def text_backend(tokenizer):
    """A copy of `plain_backend` that reads a special token's string found in a document (`<|endoftext|>` in web
    text and code, Llama 3's 256 reserved names) as the text it is: only the EOS packing appends between documents is
    special. Encoded as the token, each one was a false document boundary (position ids reset, attention cut) or a
    PAD in mid-document."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(plain_backend(tokenizer).to_str())
    copy.encode_special_tokens = True
    return copy


def tokenizer_pin(directory: str | Path) -> Path:
    """The file beside a tokenizer directory that a training run holds a shared flock on while it runs (see
    `pin_tokenizer`): `train_tokenizer --overwrite` refuses a directory whose pin is held. Beside it, not in it: the
    directory holds a tokenizer and nothing else, and its parent is where the tokenizer was written."""
    directory = Path(directory)
    return directory.parent / f".{directory.name}.readers"


def pin_tokenizer(name_or_path: str):
    """Hold the pin of a local tokenizer directory for as long as the returned lock lives (None: a hub name, or a
    directory whose parent cannot take the pin file, such as a read-only mount)."""
    from common.lock import FileLock, LockedError

    if not Path(name_or_path).is_dir():
        return None
    try:
        return FileLock(tokenizer_pin(name_or_path), shared=True, what="a run's tokenizer").acquire()
    except (OSError, LockedError):
        return None

"""The cleaning stage's own datatrove steps: the corpus reader (data_prep.reading.readers, so that a bad line or a
damaged archive is treated exactly as preprocessing treats it), a reader of one task's intermediate shard, two filters
datatrove lacks in an offline form, and the audit around every filter: documents and bytes in and out, what was
removed and why, and a few examples, saved per task as `audit/<step>/<rank>.json`."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from datatrove.data import Document
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter
from datatrove.pipeline.filters.c4_filters import C4BadWordsFilter
from datatrove.pipeline.writers.jsonl import JsonlWriter

from common.files import atomic_write_text
from data_prep.quality.cleaning.report import EXAMPLES_PER_FILTER, READ_STEP
from data_prep.reading.readers import CorruptFileError, iter_records, open_binary

EXAMPLE_CHARS = 600
SHARD_NAME = "${rank}.jsonl.zst"
# U+FFFD (a decoder's mark for bytes it could not read), C0/C1 control characters other than tab and line ends,
# the private-use area, and lone surrogates: none of them is text a model should learn to write.
UNKNOWN_CHARACTERS = re.compile("[\ufffd\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ue000-\uf8ff\ud800-\udfff]")


class CleanInputError(RuntimeError):
    """Bad input met inside a task; the message (also saved in errors/<rank>.txt for the command line) names it."""


def utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def unix_line_ends(text: str) -> str:
    """CRLF and lone CR as LF. The filters split lines and paragraphs on LF only: a page with Windows line ends was
    one line to them, each line ending in CR rather than punctuation, and every such page was removed."""
    if "\r" not in text:
        return text
    return text.replace("\r\n", "\n").replace("\r", "\n")


def audit_path(work: str | Path, step: str, rank: int) -> Path:
    return Path(work) / "audit" / step / f"{rank:05d}.json"


@dataclass
class Tally:
    """One step's counts in one task."""

    docs_in: int = 0
    bytes_in: int = 0
    docs_out: int = 0
    bytes_out: int = 0
    removed: dict = field(default_factory=dict)  # reason -> {"docs": n, "bytes": n}
    examples: list = field(default_factory=list)  # the first EXAMPLES_PER_FILTER removed documents
    skipped: dict = field(default_factory=dict)  # reader only: reason -> count, as preprocessing names them
    skipped_examples: dict = field(default_factory=dict)
    corrupt_files: list = field(default_factory=list)

    def remove(self, document: Document, reason: str) -> None:
        size = utf8_bytes(document.text)
        entry = self.removed.setdefault(reason, {"docs": 0, "bytes": 0})
        entry["docs"] += 1
        entry["bytes"] += size
        if len(self.examples) < EXAMPLES_PER_FILTER:
            self.examples.append({"reason": reason, "id": document.id, "source": document.metadata.get("source"),
                                  "text": document.text[:EXAMPLE_CHARS]})  # fmt: skip

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(asdict(self)))


class CorpusReader(PipelineStep):
    """The input files, every world_size-th one from this task's rank, read as data_prep.preprocess reads them."""

    name = "corpus reader"
    type = "📖 - READER"

    def __init__(self, files: list[str], text_field: str, strict: bool, skip_corrupt_files: bool, work: str):
        super().__init__()
        self.files, self.text_field, self.strict = files, text_field, strict
        self.skip_corrupt_files, self.work = skip_corrupt_files, work

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        tally = Tally()
        for index in range(rank, len(self.files), world_size):
            path = self.files[index]
            try:
                for record in iter_records(path, self.text_field):
                    if record.skipped:
                        self._skip(tally, record.skipped, f"{path}:{record.line}", rank)
                        continue
                    text = unix_line_ends(record.text)
                    tally.docs_out += 1
                    tally.bytes_out += utf8_bytes(text)
                    yield Document(text, f"{Path(path).name}:{record.line}",
                                   metadata={"source": path, "line": record.line})  # fmt: skip
            except CorruptFileError as error:
                if not self.skip_corrupt_files:
                    self._fail(rank, f"{error}. Replace the file, or pass --skip-corrupt-files to keep what was read "
                                     "of it and go on without the rest")  # fmt: skip
                tally.corrupt_files.append(str(error))
        tally.docs_in, tally.bytes_in = tally.docs_out, tally.bytes_out
        tally.save(audit_path(self.work, READ_STEP, rank))

    def _skip(self, tally: Tally, reason: str, where: str, rank: int) -> None:
        if self.strict:
            self._fail(rank, f"{where}: {reason.replace('_', ' ')} (--strict)")
        tally.skipped[reason] = tally.skipped.get(reason, 0) + 1
        examples = tally.skipped_examples.setdefault(reason, [])
        if len(examples) < EXAMPLES_PER_FILTER:
            examples.append(where)

    def _fail(self, rank: int, message: str):
        errors = Path(self.work) / "errors"
        errors.mkdir(parents=True, exist_ok=True)
        atomic_write_text(errors / f"{rank:05d}.txt", message)
        raise CleanInputError(message)


class ShardReader(PipelineStep):
    """This task's own intermediate shard (`<rank>.jsonl.zst`, written by the task of the same rank before): the
    MinHash signature and filter steps must see the same documents in the same order."""

    name = "shard reader"
    type = "📖 - READER"

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        import orjson

        path = Path(self.folder) / f"{rank:05d}.jsonl.zst"
        if not path.exists():  # a task whose every document was filtered out writes no shard
            return
        with open_binary(path) as handle:
            for line in handle:
                record = orjson.loads(line)
                yield Document(record["text"], record["id"], metadata=record.get("metadata", {}))


def shard_writer(folder: str | Path) -> JsonlWriter:
    return JsonlWriter(str(folder), output_filename=SHARD_NAME, compression="zstd")


class UnknownCharacterFilter(BaseFilter):
    """Drops a document whose share of UNKNOWN_CHARACTERS is above `max_share` (decoding garbage, binary junk)."""

    name = "❓ Unknown characters"

    def __init__(self, max_share: float = 0.01, exclusion_writer=None):
        super().__init__(exclusion_writer)
        if isinstance(max_share, bool) or not isinstance(max_share, int | float) or not 0 <= max_share <= 1:
            raise ValueError(f"max_share must be a share between 0 and 1 (got {max_share!r})")
        self.max_share = max_share

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        unknown = len(UNKNOWN_CHARACTERS.findall(doc.text))
        return True if unknown <= self.max_share * max(len(doc.text), 1) else (False, "unknown_characters")


class LocalBadWordsFilter(C4BadWordsFilter):
    """C4's bad-words filter with the word list read from a local file (one word or phrase per line) instead of
    downloaded at first use."""

    name = "⛰ C4 Badwords (local list)"

    def __init__(self, words_file: str, keep_fraction: float = 0.0, seed: int | None = None, exclusion_writer=None):
        super().__init__(keep_fraction=keep_fraction, fail_on_missing_language=False, seed=seed,
                         exclusion_writer=exclusion_writer)  # fmt: skip
        with open(words_file, encoding="utf-8") as handle:  # OSError: named by the config check
            words = sorted({line.strip() for line in handle if line.strip()})
        if not words:
            raise ValueError(f"words_file {words_file} holds no word")
        self.words_file = words_file
        pattern = re.compile(r"(?:\W|^)({})(?:\W|$)".format("|".join(map(re.escape, words))))
        self._badwords_regex = {language: pattern for language in ("en", "eng", None)}

    def _get_badwords(self, lang: str):
        return self._badwords_regex.get(lang, self._badwords_regex[None])


class RemovedTally(JsonlWriter):
    """A filter's exclusion writer that counts what the filter removed, by reason, keeps a few examples, and writes
    the removed documents themselves only when asked (`keep_folder`)."""

    def __init__(self, tally: Tally, default_reason: str, keep_folder: str | None, scratch_folder: str):
        super().__init__(keep_folder or scratch_folder, output_filename=SHARD_NAME, compression="zstd")
        self.tally, self.default_reason, self.keep = tally, default_reason, keep_folder is not None

    def write(self, document: Document, rank: int = 0, **kwargs):
        document.metadata.setdefault("filter_reason", self.default_reason)  # MinHash's filter gives none
        self.tally.remove(document, document.metadata["filter_reason"])
        if self.keep:
            super().write(document, rank, **kwargs)


class Audited(PipelineStep):
    """Runs one filter step and records what went in, what came out and what it removed (audit/<label>/)."""

    def __init__(self, label: str, step: PipelineStep, work: str, keep_removed: bool):
        super().__init__()
        self.label, self.step, self.work, self.keep_removed = label, step, work, keep_removed
        self.name, self.type = step.name, step.type

    def run(self, data, rank: int = 0, world_size: int = 1):
        tally = Tally()
        keep = str(Path(self.work).parent / "removed" / self.label) if self.keep_removed else None
        self.step.exclusion_writer = RemovedTally(tally, self.label, keep, str(Path(self.work) / "scratch"))

        def counted():
            for document in data:
                tally.docs_in += 1
                tally.bytes_in += utf8_bytes(document.text)
                yield document

        for document in self.step.run(counted(), rank, world_size):
            tally.docs_out += 1
            tally.bytes_out += utf8_bytes(document.text)
            yield document
        tally.save(audit_path(self.work, self.label, rank))

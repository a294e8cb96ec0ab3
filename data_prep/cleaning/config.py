"""The cleaning stage's settings: which quality filters run, in which order, with which thresholds, and the MinHash
parameters of the near-duplicate removal. Read from a small YAML (`default.yaml` beside this file is the shipped
default) and checked whole before any work starts: a mistake is one line naming its key and what would be valid."""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CONFIG = Path(__file__).with_name("default.yaml")
# Filters that exist; the classes are datatrove's, except the two of data_prep.cleaning.steps (ours: no datatrove
# filter measures decoding garbage; the C4 bad-words list is read from a local file instead of downloaded).
FILTER_CLASSES = {
    "gopher_repetition": "datatrove.pipeline.filters:GopherRepetitionFilter",
    "gopher_quality": "datatrove.pipeline.filters:GopherQualityFilter",
    "c4_quality": "datatrove.pipeline.filters:C4QualityFilter",
    "fineweb_quality": "datatrove.pipeline.filters:FineWebQualityFilter",
    "unknown_characters": "data_prep.cleaning.steps:UnknownCharacterFilter",
    "c4_badwords": "data_prep.cleaning.steps:LocalBadWordsFilter",
}
NOT_SETTABLE = {"self", "exclusion_writer", "language", "batch_size"}  # set by the stage itself


class CleanConfigError(ValueError):
    """A wrong key or value in the cleaning config; the message names it."""


@dataclass(frozen=True)
class FilterChoice:
    name: str
    arguments: dict = field(default_factory=dict)

    def build(self, language: str, exclusion_writer=None):
        cls = filter_class(self.name)
        extra = {"language": language} if "language" in inspect.signature(cls.__init__).parameters else {}
        return cls(**self.arguments, **extra, exclusion_writer=exclusion_writer)


@dataclass(frozen=True)
class DedupConfig:
    enabled: bool = True
    n_grams: int = 5
    num_buckets: int = 20
    hashes_per_bucket: int = 6
    seed: int = 1

    def minhash(self):
        from datatrove.pipeline.dedup.minhash import MinhashConfig

        return MinhashConfig(self.n_grams, self.num_buckets, self.hashes_per_bucket, self.seed)


@dataclass(frozen=True)
class CleanConfig:
    language: str = "eng"
    filters: tuple[FilterChoice, ...] = ()
    dedup: DedupConfig = field(default_factory=DedupConfig)

    def to_dict(self) -> dict:
        return {
            "language": self.language,
            "filters": {choice.name: choice.arguments for choice in self.filters},
            "dedup": asdict(self.dedup),
        }


def filter_class(name: str):
    import importlib

    module, _, attribute = FILTER_CLASSES[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def load_clean_config(path: str | Path | None = None) -> CleanConfig:
    """The config at `path` (the shipped default when None), checked; CleanConfigError names what is wrong."""
    path = Path(path) if path else DEFAULT_CONFIG
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as error:
        raise CleanConfigError(f"--config {path}: cannot be read ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise CleanConfigError(f"--config {path}: not valid YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise CleanConfigError(f"--config {path}: expected a mapping with language, filters and dedup")
    unknown = set(raw) - {"language", "filters", "dedup"}
    if unknown:
        raise CleanConfigError(f"{path}: unknown key(s) {sorted(unknown)}; valid: language, filters, dedup")
    language = str(raw.get("language", "eng"))
    check_language(path, language)
    config = CleanConfig(language, _filters(path, raw.get("filters") or {}), _dedup(path, raw.get("dedup") or {}))
    for choice in config.filters:  # building each once finds a value of the wrong type or out of range
        try:
            choice.build(language)
        except (TypeError, ValueError, OSError) as error:
            raise CleanConfigError(f"{path}: filters.{choice.name}: {error}") from None
    return config


def check_language(path: Path, language: str) -> None:
    from datatrove.utils.word_tokenizers import load_tokenizer_assignments

    if language not in load_tokenizer_assignments():
        raise CleanConfigError(f"{path}: language {language!r} has no word tokenizer in datatrove; use an ISO 639-3 "
                               "code such as eng, deu, fra")  # fmt: skip


def _filters(path: Path, raw: Any) -> tuple[FilterChoice, ...]:
    if not isinstance(raw, dict):
        raise CleanConfigError(f"{path}: filters must map filter names to their settings")
    chosen = []
    for name, arguments in raw.items():
        if name not in FILTER_CLASSES:
            raise CleanConfigError(f"{path}: filters.{name} is not a filter; valid: {', '.join(FILTER_CLASSES)}")
        if arguments is False or arguments is None and name == "c4_badwords":
            continue
        arguments = {} if arguments in (None, True) else arguments
        if not isinstance(arguments, dict):
            raise CleanConfigError(f"{path}: filters.{name} must be a mapping of arguments, true or false")
        defaults = inspect.signature(filter_class(name).__init__).parameters
        allowed = set(defaults) - NOT_SETTABLE
        wrong = sorted(set(arguments) - allowed)
        if wrong:
            raise CleanConfigError(f"{path}: filters.{name}.{wrong[0]} is not a setting of this filter; valid: "
                                   f"{', '.join(sorted(allowed))}")  # fmt: skip
        for key, value in arguments.items():
            _check_type(path, f"filters.{name}.{key}", value, defaults[key].default)
        chosen.append(FilterChoice(name, {key: _tuples(value) for key, value in arguments.items()}))
    return tuple(chosen)


def _check_type(path: Path, key: str, value, default) -> None:
    """A value of the default's kind (a number for a number, ...): datatrove's filters take what they are given and
    would fail in every task instead (YAML reads 1e-2 as a string, for one)."""
    if default is None or default is inspect.Parameter.empty:
        return
    kinds = {bool: ((bool,), "true or false"), int: ((int, float), "a number"), float: ((int, float), "a number"),
             str: ((str,), "a string"), tuple: ((list, tuple), "a list")}  # fmt: skip
    expected, words = next((kinds[kind] for kind in kinds if isinstance(default, kind)), ((object,), ""))
    if not isinstance(value, expected) or isinstance(value, bool) and bool not in expected:
        hint = " (YAML reads 1e-2 as a string: write 0.01)" if isinstance(value, str) and words == "a number" else ""
        raise CleanConfigError(f"{path}: {key} must be {words} like its default {default!r}, not {value!r}{hint}")


def _tuples(value):
    """YAML lists as tuples: datatrove's n-gram thresholds are tuples of (n, share) pairs."""
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def _dedup(path: Path, raw: Any) -> DedupConfig:
    if not isinstance(raw, dict):
        raise CleanConfigError(f"{path}: dedup must be a mapping (enabled, n_grams, num_buckets, ...)")
    valid = set(DedupConfig.__dataclass_fields__)
    if set(raw) - valid:
        raise CleanConfigError(f"{path}: dedup.{sorted(set(raw) - valid)[0]} is not a setting; valid: "
                               f"{', '.join(sorted(valid))}")  # fmt: skip
    if not isinstance(raw.get("enabled", True), bool):
        raise CleanConfigError(f"{path}: dedup.enabled must be true or false")
    for key in ("n_grams", "num_buckets", "hashes_per_bucket", "seed"):
        value = raw.get(key, getattr(DedupConfig, key))
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "seed" else 1):
            raise CleanConfigError(f"{path}: dedup.{key} must be a positive whole number (got {value!r})")
    return DedupConfig(**raw)

"""The cleaning stage's settings: which quality filters run, in which order, with which thresholds, and the MinHash
parameters of the near-duplicate removal. Read from a small YAML and checked whole before any work starts: a mistake
is one line naming its key and what would be valid. Two are shipped beside this file, chosen by `--preset`: `web`
(`default.yaml`, crawled pages) and `curated` (`curated.yaml`, books and documentation with code and markup)."""

from __future__ import annotations

import contextlib
import inspect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:  # datatrove is imported later, offline (data_prep.clean)
    from datatrove.utils.word_tokenizers import WordTokenizer

DEFAULT_CONFIG = Path(__file__).with_name("default.yaml")
PRESETS = {"web": DEFAULT_CONFIG, "curated": Path(__file__).with_name("curated.yaml")}
# Filters that exist; the classes are datatrove's, except the two of data_prep.quality.cleaning.steps (ours: no
# datatrove filter measures decoding garbage; the C4 bad-words list is read from a local file instead of downloaded).
FILTER_CLASSES = {  # in the order the shipped presets run them
    "unknown_characters": "data_prep.quality.cleaning.steps:UnknownCharacterFilter",
    "gopher_repetition": "datatrove.pipeline.filters:GopherRepetitionFilter",
    "gopher_quality": "datatrove.pipeline.filters:GopherQualityFilter",
    "c4_quality": "datatrove.pipeline.filters:C4QualityFilter",
    "fineweb_quality": "datatrove.pipeline.filters:FineWebQualityFilter",
    "c4_badwords": "data_prep.quality.cleaning.steps:LocalBadWordsFilter",
}
# What a run builds in their place: the same filter, counted faster to the same decisions (data_prep.quality.cleaning.
# repetition; tests/test_clean_speed.py holds it to the class above). Its arguments are the class's above.
FAST_FILTER_CLASSES = {"gopher_repetition": "data_prep.quality.cleaning.repetition:RepetitionFilter"}
NOT_SETTABLE = {"self", "exclusion_writer", "language", "batch_size"}  # set by the stage itself


class CleanConfigError(ValueError):
    """A wrong key or value in the cleaning config; the message names it."""


@dataclass(frozen=True)
class Rule:
    """What one filter argument may be. datatrove's filters take any value and compare with it: `max_doc_words: -3`
    or `line_punct_thr: 5` removed every document of a run that exited 0."""

    kind: str  # share (a number in [0, 1]), number (>= low), whole (a whole number >= low), flag, words, path, n_grams
    low: int = 0
    off: int | None = None  # one more valid value below `low` that turns the check off (C4's -1)
    nullable: bool = False  # null is valid: the argument's default, which the class replaces (its own list, a seed)

    def words(self) -> str:
        kinds = {"share": "a number between 0 and 1", "number": f"a number >= {self.low}",
                 "whole": f"a whole number >= {self.low}", "flag": "true or false", "words": "a list of strings",
                 "path": "a path", "n_grams": "a list of [n, share] pairs (n a whole number >= 1, share between 0 "
                                              "and 1)"}  # fmt: skip
        text = kinds[self.kind]
        if self.off is not None:
            text = f"{self.off} (off) or {text}"
        return f"null or {text}" if self.nullable else text

    def problem(self, value) -> str | None:
        """None when `value` is valid, else what it must be."""
        if value is None and self.nullable:
            return None
        if self.kind == "flag":
            valid = isinstance(value, bool)
        elif self.kind == "words":
            valid = isinstance(value, list | tuple) and all(isinstance(item, str) for item in value)
        elif self.kind == "path":
            valid = isinstance(value, str) and bool(value)
        elif self.kind == "n_grams":
            valid = isinstance(value, list | tuple) and all(
                isinstance(pair, list | tuple) and len(pair) == 2 and _whole(pair[0]) and pair[0] >= 1
                and _number(pair[1]) and 0 <= pair[1] <= 1 for pair in value)  # fmt: skip
        elif self.kind == "whole":
            valid = _whole(value) and (value >= self.low or value == self.off)
        else:
            valid = _number(value) and value >= self.low and (self.kind != "share" or value <= 1)
        return None if valid else self.words()


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


SHARE, FLAG = Rule("share"), Rule("flag")
# Every settable argument of every filter (a test holds this to the classes' signatures). Gopher's checks compare
# counts of words, lengths and shares of lines; C4 takes -1 for "off" where its docstring says so.
ARGUMENT_RULES = {
    "unknown_characters": {"max_share": SHARE},
    "gopher_repetition": {"dup_line_frac": SHARE, "dup_para_frac": SHARE, "dup_line_char_frac": SHARE,
                          "dup_para_char_frac": SHARE, "top_n_grams": Rule("n_grams"), "dup_n_grams": Rule("n_grams")},
    "gopher_quality": {"min_doc_words": Rule("whole"), "max_doc_words": Rule("whole"),
                       "min_avg_word_length": Rule("number"), "max_avg_word_length": Rule("number"),
                       "max_symbol_word_ratio": Rule("number"),  # `#` or `...` per word: can pass 1
                       "max_bullet_lines_ratio": SHARE, "max_ellipsis_lines_ratio": SHARE,
                       "max_non_alpha_words_ratio": SHARE, "min_stop_words": Rule("whole"),
                       "stop_words": Rule("words", nullable=True)},
    "c4_quality": {"split_paragraph": FLAG, "remove_citations": FLAG, "filter_no_terminal_punct": FLAG,
                   "min_num_sentences": Rule("whole", off=-1), "min_words_per_line": Rule("whole", off=-1),
                   "max_word_length": Rule("whole", low=1, off=-1), "filter_lorem_ipsum": FLAG,
                   "filter_javascript": FLAG, "filter_curly_bracket": FLAG, "filter_policy": FLAG},
    "fineweb_quality": {"line_punct_thr": SHARE, "line_punct_exclude_zero": FLAG,
                        "stop_chars": Rule("words", nullable=True), "short_line_thr": SHARE,
                        "short_line_length": Rule("whole"), "char_duplicates_ratio": SHARE,
                        "new_line_ratio": Rule("number")},  # line breaks per word: can pass 1
    "c4_badwords": {"words_file": Rule("path"), "keep_fraction": SHARE, "seed": Rule("whole", nullable=True)},
}  # fmt: skip
# (min, max) argument pairs: a minimum over its maximum keeps nothing. 0 turns a Gopher check off.
ORDERED_PAIRS = {"gopher_quality": [("min_doc_words", "max_doc_words"), ("min_avg_word_length", "max_avg_word_length")]}
DEDUP_RULES = {"enabled": FLAG, "n_grams": Rule("whole", low=1), "num_buckets": Rule("whole", low=1),
               "hashes_per_bucket": Rule("whole", low=1), "seed": Rule("whole")}  # fmt: skip
A_WHOLE_SET = (
    "a --config is a whole set of filters, not changes to a preset: start from one under data_prep/quality/cleaning/"
)


@dataclass(frozen=True)
class FilterChoice:
    name: str
    arguments: dict = field(default_factory=dict)

    def build(self, language: str | WordTokenizer, exclusion_writer=None, fast: bool = False):
        """The filter step. `language`: the config's ISO 639-3 code, or the word tokenizer the filters share
        (data_prep.quality.cleaning.words); `fast`: the faster class where there is one (FAST_FILTER_CLASSES)."""
        cls = filter_class(self.name, fast)
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


def filter_class(name: str, fast: bool = False):
    import importlib

    path = (FAST_FILTER_CLASSES.get(name) if fast else None) or FILTER_CLASSES[name]
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def load_clean_config(path: str | Path | None = None) -> CleanConfig:
    """The config at `path` (the shipped default when None), checked; CleanConfigError names what is wrong."""
    path = Path(path) if path else DEFAULT_CONFIG
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as error:
        raise CleanConfigError(f"--config {path}: cannot be read ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise CleanConfigError(f"--config {path}: not valid YAML ({str(error).splitlines()[0]})") from None
    if raw is None:  # an empty file, or every line a comment: it ran no filter, silently
        raise CleanConfigError(f"--config {path} is empty; {A_WHOLE_SET}")
    if not isinstance(raw, dict):
        raise CleanConfigError(f"--config {path}: expected a mapping with language, filters and dedup")
    unknown = set(raw) - {"language", "filters", "dedup"}
    if unknown:
        raise CleanConfigError(f"{path}: unknown key(s) {sorted(unknown)}; valid: language, filters, dedup")
    language = str(raw.get("language", "eng"))
    check_language(path, language)
    for key, meaning in (("filters", "no quality filter"), ("dedup", "dedup with its defaults")):
        if key in raw and raw[key] is None:
            raise CleanConfigError(f"{path}: {key} is empty (null): write {key}: {{}} to run {meaning}")
    config = CleanConfig(language, _filters(path, raw.get("filters", {})), _dedup(path, raw.get("dedup", {})))
    if "filters" not in raw:
        raise CleanConfigError(f"{path} has no filters key; {A_WHOLE_SET} (filters: {{}} runs none)")
    if not config.filters and not config.dedup.enabled:
        raise CleanConfigError(f"{path}: no filter runs and dedup is off: the run would only copy its input")
    for choice in config.filters:  # building each once finds what the rules cannot (a words_file that is not there)
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
        if arguments is None:  # `gopher_quality:` with every argument commented out: on or off? Say which.
            raise CleanConfigError(f"{path}: filters.{name} is empty (null): write {{}} for its defaults or false to "
                                   "turn it off")  # fmt: skip
        if arguments is False:
            continue
        arguments = {} if arguments is True else arguments
        if not isinstance(arguments, dict):
            raise CleanConfigError(f"{path}: filters.{name} must be a mapping of arguments, true or false")
        rules = ARGUMENT_RULES[name]
        wrong = sorted(set(arguments) - set(rules))
        if wrong:
            raise CleanConfigError(f"{path}: filters.{name}.{wrong[0]} is not a setting of this filter; valid: "
                                   f"{', '.join(sorted(rules))}")  # fmt: skip
        for key, value in arguments.items():
            _check_value(path, f"filters.{name}.{key}", value, rules[key])
        _check_order(path, name, arguments)
        chosen.append(FilterChoice(name, {key: _tuples(value) for key, value in arguments.items()}))
    return tuple(chosen)


def _check_value(path: Path, key: str, value, rule: Rule) -> None:
    """A value the filter can use: datatrove's filters take what they are given, and a value out of range keeps
    nothing (or everything) while the run exits 0; one of the wrong type fails in every task."""
    expected = rule.problem(value)
    if expected:
        hint = ""
        if isinstance(value, str) and rule.kind in ("share", "number", "whole"):
            with contextlib.suppress(ValueError):  # only for a number YAML misread (`fifty` is just not a number)
                hint = f" (YAML reads {value} as a string: write {float(value)!r})"
        shown = "null" if value is None else repr(value)
        raise CleanConfigError(f"{path}: {key} must be {expected}, not {shown}{hint}")


def _check_order(path: Path, name: str, arguments: dict) -> None:
    defaults = inspect.signature(filter_class(name).__init__).parameters
    for low, high in ORDERED_PAIRS.get(name, []):
        values = {key: arguments.get(key, defaults[key].default) for key in (low, high)}
        if values[low] and values[high] and values[low] > values[high]:  # 0 (or null) is a check turned off
            shown = {key: f"{values[key]}{'' if key in arguments else ', its default'}" for key in values}
            raise CleanConfigError(f"{path}: filters.{name}.{low} ({shown[low]}) is more than filters.{name}.{high} "
                                   f"({shown[high]}): no document can pass")  # fmt: skip


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
        if DEDUP_RULES[key].problem(value):
            raise CleanConfigError(f"{path}: dedup.{key} must be a positive whole number (got {value!r})")
    return DedupConfig(**raw)


def _default_text(value) -> str:
    if value is inspect.Parameter.empty:
        return "(required)"
    return "`" + json.dumps(_lists(value)) + "`" if value is not None else "`null`"


def _lists(value):
    return [_lists(item) for item in value] if isinstance(value, list | tuple) else value


def filters_table() -> list[str]:
    """Every filter's settable arguments with the class's default, what each preset sets and what is valid, as a
    markdown table (`python -m data_prep.clean --list-filters`; docs/data-cleaning.md holds this table, and a test
    keeps it equal)."""
    presets = {name: load_clean_config(path) for name, path in PRESETS.items()}
    chosen = {name: {choice.name: choice.arguments for choice in config.filters} for name, config in presets.items()}
    header = " | ".join(f"`--preset {name}`" for name in presets)
    lines = [f"| filter | argument | default | {header} | valid |", "|---|---|---|" + "---|" * (len(presets) + 1)]
    for name in FILTER_CLASSES:
        parameters = inspect.signature(filter_class(name).__init__).parameters
        for key, parameter in parameters.items():
            if key in NOT_SETTABLE or parameter.kind is parameter.VAR_KEYWORD:
                continue
            cells = []
            for preset in presets:
                arguments = chosen[preset].get(name)
                cells.append("off" if arguments is None else _default_text(arguments[key]) if key in arguments else "")
            lines.append(f"| `{name}` | `{key}` | {_default_text(parameter.default)} | {' | '.join(cells)} | "
                         f"{ARGUMENT_RULES[name][key].words()} |")  # fmt: skip
    for key, default in asdict(DedupConfig()).items():
        cells = [_default_text(getattr(config.dedup, key)) if getattr(config.dedup, key) != default else ""
                 for config in presets.values()]  # fmt: skip
        lines.append(f"| `dedup` | `{key}` | {_default_text(default)} | {' | '.join(cells)} | "
                     f"{DEDUP_RULES[key].words()} |")  # fmt: skip
    return lines

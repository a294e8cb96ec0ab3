"""The cleaning stage's two shipped presets (web for crawled pages, curated for books and documentation with code
and markup), the warning a run that removes most of its input ends with, the table of every filter's arguments in
docs/data-cleaning.md (generated, so it cannot drift), and the edges of a rerun and of --workers: a changed config
named key by key, a worker count larger than the tasks said in one line."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from data_prep.quality.cleaning.config import PRESETS, filters_table, load_clean_config
from data_prep.quality.cleaning.report import RUN_WARNING, STEP_WARNING, clean_warnings
from tests.conftest import REPO
from tests.test_clean import english_like, output_lines, refusal, run_clean

DOC = REPO / "docs" / "data-cleaning.md"


def technical_document(rng: random.Random, vocabulary: list[str]) -> str:
    """A page of documentation in markdown: headings, prose, and indented code blocks with brackets and operators
    (what the web preset's Gopher, C4 and FineWeb rules take for junk)."""
    sections = []
    for _ in range(4):
        name, argument, key = (rng.choice(vocabulary) for _ in range(3))
        code = [
            "```python",
            f"def {name}({argument}: dict, limit: int = {rng.randint(2, 99)}) -> list:",
            f'    """{english_like(rng, vocabulary, 8).splitlines()[0]}"""',
            f"    found = [{argument}[key] for key in sorted({argument}) if key != '{key}']",
            f"    return {{'{key}': found[:limit], 'count': len(found) + {rng.randint(1, 9)}}}",
            "```",
        ]
        sections += [f"## The {name} function", "", english_like(rng, vocabulary, 45), "", *code, ""]
    return "\n".join(sections)


@pytest.fixture(scope="module")
def technical(tmp_path_factory) -> Path:
    """One input file of 30 such pages."""
    rng = random.Random(11)
    syllables = ["ka", "lo", "mi", "ten", "ra", "su", "vel", "dor", "pan", "qui", "ber", "sto", "fla", "gor", "nim"]
    vocabulary = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))) for _ in range(4000)})
    path = tmp_path_factory.mktemp("technical") / "manual.jsonl"
    path.write_text("".join(json.dumps({"text": technical_document(rng, vocabulary)}) + "\n" for _ in range(30)))
    return path


def test_every_shipped_preset_loads_and_keeps_dedup_on():
    configs = {name: load_clean_config(path) for name, path in PRESETS.items()}
    assert set(configs) == {"web", "curated"}
    for config in configs.values():
        assert config.dedup.enabled and config.dedup.num_buckets * config.dedup.hashes_per_bucket == 120
    curated = {choice.name: choice.arguments for choice in configs["curated"].filters}
    assert "c4_quality" not in curated, "C4 strips code indentation and drops a document for one {"
    assert curated["gopher_quality"]["max_non_alpha_words_ratio"] == 0.5
    assert list(curated) == ["unknown_characters", "gopher_repetition", "gopher_quality", "fineweb_quality"]


@pytest.mark.multiprocess
def test_the_web_preset_warns_on_documentation_and_curated_keeps_its_code(technical, tmp_path):
    """On pages of prose and code, the web preset removes every page: warnings on stderr and in both reports naming
    gopher_quality, its reason and --preset curated, and, with no document left, exit 2 and a last line saying so
    with the same fix; the curated preset keeps every page with its code blocks as they were (indentation, braces)
    and warns about nothing. One input file and --workers 2: one line (stdout, with the progress lines) says that
    only one task has input."""
    web = run_clean([str(technical)], tmp_path / "web")
    assert web.returncode == 2, web.stderr[-3000:]
    warnings = [line for line in web.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings and all("gopher_quality" in line and "--preset curated" in line for line in warnings), web.stderr
    assert any("gopher_below_alpha_threshold" in line and "the run removed" in line for line in warnings)
    error = web.stderr.strip().splitlines()[-1]
    assert error.startswith("error: the output holds no document: all 30 documents read were removed, most by "
                            "gopher_quality") and "--preset curated" in error, web.stderr  # fmt: skip
    report = json.loads((tmp_path / "web" / "clean_report.json").read_text())
    assert report["preset"] == "web" and [f"warning: {line}" for line in report["warnings"][1:]] == warnings
    assert f"error: {report['warnings'][0]}" == error
    assert f"**Warning:** {report['warnings'][1]}" in (tmp_path / "web" / "clean_report.md").read_text()
    notes = [line for line in web.stdout.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "--workers 2" in notes[0] and "1 task(s) with input" in notes[0], web.stdout
    assert "Traceback" not in web.stderr

    curated = run_clean([str(technical)], tmp_path / "curated", "--preset", "curated")
    assert curated.returncode == 0, curated.stderr[-3000:]
    assert "warning: " not in curated.stderr
    kept = {record["id"]: record["text"] for record in output_lines(tmp_path / "curated")}
    originals = [json.loads(line)["text"] for line in technical.read_text().splitlines()]
    assert list(kept.values()) == originals, "every page kept, byte for byte"
    assert json.loads((tmp_path / "curated" / "clean_report.json").read_text())["warnings"] == []


@pytest.mark.multiprocess
def test_pages_with_windows_line_ends_are_cleaned_as_the_same_pages_with_unix_ones(technical, tmp_path):
    """The filters split lines on LF only: the curated preset removed every one of these pages once their lines ended
    in CRLF (each line ending in CR, not punctuation). Line ends become LF as the documents are read, so the pages
    are kept, and written with LF."""
    crlf = tmp_path / "manual_crlf.jsonl"
    originals = [json.loads(line)["text"] for line in technical.read_text().splitlines()]
    crlf.write_text("".join(json.dumps({"text": text.replace("\n", "\r\n")}) + "\n" for text in originals))
    curated = run_clean([str(crlf)], tmp_path / "curated", "--preset", "curated")
    assert curated.returncode == 0, curated.stderr[-3000:]
    assert [record["text"] for record in output_lines(tmp_path / "curated")] == originals


def a_report(read_bytes: int, steps: dict[str, tuple[int, int, dict]], preset: str | None = "web") -> dict:
    """A report holding only what the warnings read: per step (bytes in, bytes out, {reason: bytes removed})."""
    tallies = {
        step: {"bytes_in": bytes_in, "bytes_out": bytes_out,
               "removed": {reason: {"docs": 1, "bytes": size} for reason, size in reasons.items()}}
        for step, (bytes_in, bytes_out, reasons) in steps.items()
    }  # fmt: skip
    last = list(steps.values())[-1][1] if steps else read_bytes
    return {"preset": preset, "read": {"bytes_out": read_bytes}, "steps": tallies, "output": {"bytes": last}}


def test_a_warning_when_the_run_removes_over_half_or_a_filter_over_a_third_of_what_it_saw():
    assert RUN_WARNING == 0.5 and pytest.approx(1 / 3) == STEP_WARNING
    quiet = a_report(1000, {"gopher_quality": (1000, 670, {"gopher_short_doc": 330}),
                            "fineweb_quality": (670, 510, {"line_punct_ratio": 160})})  # fmt: skip
    assert clean_warnings(quiet) == [], "49 % removed in all, no step over a third"
    step = a_report(1000, {"gopher_quality": (1000, 900, {"gopher_short_doc": 100}),
                           "fineweb_quality": (900, 590, {"line_punct_ratio": 250, "char_dup_ratio": 60})})  # fmt: skip
    (warning,) = clean_warnings(step)
    assert warning.startswith("fineweb_quality removed 34.4% of the bytes it saw")
    assert "most for line_punct_ratio (81% of them)" in warning
    assert "--preset curated" in warning and "filters.fineweb_quality.line_punct_thr" in warning
    run = a_report(1000, {"gopher_quality": (1000, 700, {"gopher_below_alpha_threshold": 300}),
                          "c4_quality": (700, 490, {"curly_bracket": 10})})  # fmt: skip
    (warning,) = clean_warnings(run)
    assert warning.startswith("the run removed 51.0% of the bytes read")
    assert "most by gopher_quality" in warning and "filters.gopher_quality.max_non_alpha_words_ratio" in warning
    cut = clean_warnings(a_report(1000, {"c4_quality": (1000, 400, {"curly_bracket": 100})}, preset="curated"))
    assert "most for lines cut from kept documents" in cut[1] and "filters.c4_quality.min_words_per_line" in cut[1]
    assert "--preset curated" not in cut[1] and "curated.yaml" in cut[1]
    own = clean_warnings(a_report(1000, {"gopher_repetition": (1000, 400, {"top_2_gram": 600})}, preset=None))
    assert "filters.gopher_repetition.top_n_grams in your --config" in own[1]
    copies = clean_warnings(a_report(1000, {"near_duplicates": (1000, 300, {"near_duplicates": 700})}))
    assert "near-copies" in copies[1] and "dedup.enabled: false" in copies[1]


def test_every_key_a_warning_names_is_an_argument_of_a_filter():
    import inspect

    from data_prep.quality.cleaning.config import FILTER_CLASSES, filter_class
    from data_prep.quality.cleaning.report import REASON_KEYS

    arguments = {key for name in FILTER_CLASSES for key in inspect.signature(filter_class(name).__init__).parameters}
    assert set(REASON_KEYS.values()) | {"top_n_grams", "dup_n_grams", "min_words_per_line"} <= arguments


def test_importing_the_cleaning_cli_leaves_the_processs_hub_setting_alone():
    """It set HF_HUB_OFFLINE=1 at import, for anything else in the process (an evaluation then refused hub tasks)."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    code = "import os, data_prep.quality.cleaning.cli; print(os.environ.get('HF_HUB_OFFLINE'))"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "None"


def test_the_filter_table_in_the_docs_is_the_generated_one_and_lists_every_argument(capsys, monkeypatch):
    from data_prep.quality.cleaning.cli import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # main sets it: not for the tests after this one
    from data_prep.quality.cleaning.config import FILTER_CLASSES, NOT_SETTABLE, filter_class

    generated = filters_table()
    assert main(["--list-filters"]) == 0
    assert capsys.readouterr().out.splitlines() == generated
    assert "\n".join(generated) in DOC.read_text(), "docs/data-cleaning.md: paste `python -m data_prep.clean " \
                                                    "--list-filters` over its table of arguments"  # fmt: skip
    import inspect

    rows = {tuple(re.findall(r"`([^`]+)`", line)[:2]) for line in generated[2:]}
    for name in FILTER_CLASSES:
        for key in set(inspect.signature(filter_class(name).__init__).parameters) - NOT_SETTABLE:
            assert (name, key) in rows, f"{name}.{key} is missing from the table"
    assert ("gopher_quality", "max_non_alpha_words_ratio") in rows and ("dedup", "num_buckets") in rows
    row = next(line for line in generated if "`max_non_alpha_words_ratio`" in line)
    assert row == "| `gopher_quality` | `max_non_alpha_words_ratio` | `0.8` |  | `0.5` | a number between 0 and 1 |"


def test_a_preset_and_a_config_together_are_one_line(tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("filters: {gopher_quality: {}}\n")
    error = refusal(capsys, [str(tmp_path / "any.jsonl")], tmp_path / "out", "--preset", "curated", "--config",
                    str(config))  # fmt: skip
    assert "--preset curated and --config" in error and "choose one" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.multiprocess
def test_a_changed_config_on_a_rerun_is_refused_naming_each_changed_key(technical, tmp_path, capsys):
    """The refusal names the keys that changed, old -> new, not the two whole configs."""
    first = run_clean([str(technical)], tmp_path / "out", "--preset", "curated")
    assert first.returncode == 0, first.stderr[-3000:]
    config = tmp_path / "changed.yaml"
    curated = load_clean_config(PRESETS["curated"]).to_dict()
    curated["filters"]["gopher_quality"]["min_stop_words"] = 3
    curated["filters"].pop("fineweb_quality")
    curated["dedup"]["enabled"] = False
    config.write_text(json.dumps(curated))  # JSON is YAML
    error = refusal(capsys, [str(technical)], tmp_path / "out", "--config", str(config))
    assert "config.filters.gopher_quality.min_stop_words: absent -> 3" in error
    assert 'config.filters.fineweb_quality: {"line_punct_thr": 0.02' in error and "} -> off" in error
    assert "config.dedup.enabled: true -> false" in error
    assert "max_non_alpha_words_ratio" not in error, "an unchanged key is not named"
    error = refusal(capsys, [str(technical)], tmp_path / "out", "--preset", "curated", "--strict")
    assert "strict: false -> true" in error


def test_the_inputs_of_a_changed_rerun_are_named_as_files_added_and_removed():
    from data_prep.quality.cleaning.runner import changed_settings

    before = {"inputs": ["/a", "/b", "/c"], "config": {"language": "eng"}, "filter_order": ["x", "y"], "tasks": 3}
    after = {"inputs": ["/a", "/c", "/d"], "config": {"language": "eng"}, "filter_order": ["y", "x"], "tasks": 3}
    assert changed_settings(before, after) == ["inputs: /b removed, /d added", "filter_order: x, y -> y, x"]
    assert changed_settings(before, {**before, "inputs": ["/c", "/b", "/a"]}) == [
        "inputs: the same files in another order"]  # fmt: skip
    assert changed_settings(before, before) == []


def test_the_data_report_of_a_cleaned_corpus_repeats_its_warnings(tmp_path):
    from data_prep.quality.cleaning.report import REPORT_JSON, cleaning_section

    report = a_report(1000, {"gopher_quality": (1000, 300, {"gopher_below_alpha_threshold": 700})})
    report |= {"read": {"docs_out": 10, "bytes_out": 1000}, "output": {"docs": 3, "bytes": 300}}
    for step in report["steps"].values():
        step |= {"docs_in": 10, "docs_out": 3, "share_of_corpus": {"docs": 0.7, "bytes": 0.7}}
    report["warnings"] = clean_warnings(report)
    (tmp_path / REPORT_JSON).write_text(json.dumps(report))
    section = "\n".join(cleaning_section(tmp_path / REPORT_JSON))
    assert len(report["warnings"]) == 2 and all(f"**Warning:** {line}" in section for line in report["warnings"])

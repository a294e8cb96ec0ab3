"""The cleaning stage (data_prep.clean, on datatrove): quality filters and near-duplicate removal across every input
file, with no network; its report; a kill at any moment continued by the same command to the same output; one run
per output; changed settings or inputs refused; bad input handled as preprocessing handles it; and its output read
by data_prep.preprocess, whose data report links the cleaning report. The tests that run the command are marked
`multiprocess` (it runs its tasks in parallel processes): they are in `make test`, not in `make test-fast`."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import zstandard

from benchmarks.clean_quality import near_copy
from common.process import kill_tree
from data_prep.quality.cleaning.config import CleanConfigError, load_clean_config
from data_prep.reading.readers import open_binary
from tests.conftest import LAUNCH_ENV, REPO

STOP_WORDS = ["the", "of", "and", "to", "in", "that", "with", "is", "was", "for", "on", "as", "be", "have", "it"]
REPETITION = "Buy the best deals now and save. " * 60


def english_like(rng: random.Random, vocabulary: list[str], words: int = 260) -> str:
    """Paragraphs of sentences over a random vocabulary with English stop words: passes the quality filters, and two
    of them share almost no word 5-gram."""
    paragraphs, count = [], 0
    while count < words:
        sentences = []
        for _ in range(rng.randint(3, 5)):
            sentence = [rng.choice(vocabulary if rng.random() < 0.6 else STOP_WORDS) for _ in range(rng.randint(8, 15))]
            sentences.append(" ".join(sentence).capitalize() + ".")
        paragraphs.append(" ".join(sentences))
        count += sum(len(s.split()) for s in sentences)
    return "\n".join(paragraphs)


def write_cleaning_corpus(folder: Path, documents: int = 90, copies: int = 12) -> dict:
    """Three input files (jsonl with a BOM and a malformed line, .jsonl.gz, .jsonl.zst): `documents` distinct
    documents, a near-copy of `copies` of them in another file than the original, and the NOISE documents. Returns
    the files, {copy id: original id} in data_prep.clean's ids (file name:line) and the noise's (id, bytes)."""
    rng = random.Random(7)
    syllables = ["ka", "lo", "mi", "ten", "ra", "su", "vel", "dor", "pan", "qui", "ber", "sto", "fla", "gor", "nim"]
    vocabulary = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))) for _ in range(5000)})
    names = ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]
    lines: list[list[str]] = [[], [], []]
    texts = [english_like(rng, vocabulary) for _ in range(documents)]
    where = []
    for index, text in enumerate(texts):
        lines[index % 3].append(json.dumps({"text": text}))
        where.append(f"{names[index % 3]}:{len(lines[index % 3])}")
    pairs = {}
    for index in range(copies):
        target = (index + 1) % 3  # another file than the original's
        # one word in 200 changed (the benchmark's 2 % would make this test's outcome a matter of MinHash's odds:
        # similarity ~0.88 is found with probability 1 - 1e-4, ~0.74 with 0.96; benchmarks/ measures the latter)
        lines[target].append(json.dumps({"text": near_copy(texts[index], vocabulary, rng, changed=0.005)}))
        pairs[f"{names[target]}:{len(lines[target])}"] = where[index]
    lines[0].insert(5, "{not json")  # a bad line, skipped and counted (line 6)
    garbled = "".join(c + ("\ufffd" if i % 12 == 0 else "") for i, c in enumerate(english_like(rng, vocabulary)))
    noise = {}
    for key, text in (("repetition", REPETITION), ("garbled", garbled)):
        lines[2].append(json.dumps({"text": text}))
        noise[key] = (f"{names[2]}:{len(lines[2])}", len(text.encode()))
    folder.mkdir(parents=True, exist_ok=True)
    payloads = ["\n".join(part).encode() + b"\n" for part in lines]
    (folder / names[0]).write_bytes(b"\xef\xbb\xbf" + payloads[0])
    (folder / names[1]).write_bytes(gzip.compress(payloads[1]))
    half = payloads[2].index(b"\n", len(payloads[2]) // 2) + 1  # two frames: a cut in the second keeps the first
    frames = [zstandard.ZstdCompressor().compress(part) for part in (payloads[2][:half], payloads[2][half:])]
    (folder / names[2]).write_bytes(b"".join(frames))
    return {"files": [str(folder / name) for name in names], "pairs": pairs, "noise": noise, "distinct": documents}


def clean_command(inputs: list[str], output: Path, *extra: str) -> list[str]:
    command = [sys.executable, "-m", "data_prep.clean", "--input", *inputs, "--output", str(output), "--workers", "2"]
    return [*command, *extra]


def offline(command: list[str]) -> list[str]:
    """The command without a network (its own empty network namespace) where this machine allows it."""
    allowed = shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    return ["unshare", "-n", *command] if allowed else command


def run_clean(inputs: list[str], output: Path, *extra: str, timeout_s: int = 300) -> subprocess.CompletedProcess:
    command = offline(clean_command(inputs, output, *extra))
    return subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=timeout_s)


def output_lines(output: Path) -> list[dict]:
    records = []
    for shard in sorted((output / "data").glob("*.jsonl.zst")):
        with open_binary(shard) as handle:
            records += [json.loads(line) for line in handle]
    return records


@pytest.fixture(scope="module")
def cleaned(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("clean")
    corpus = write_cleaning_corpus(root / "raw")
    started = time.perf_counter()
    result = run_clean(corpus["files"], root / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Bad file descriptor" not in result.stderr, result.stderr
    return {**corpus, "out": root / "out", "root": root, "wall_s": time.perf_counter() - started,
            "stdout": result.stdout}  # fmt: skip


@pytest.mark.multiprocess
def test_noise_and_near_copies_in_other_files_are_removed_and_reported(cleaned):
    kept = {record["id"] for record in output_lines(cleaned["out"])}
    for copy_id, original in cleaned["pairs"].items():
        assert (copy_id in kept) != (original in kept), (copy_id, original)
    assert not {doc_id for doc_id, _ in cleaned["noise"].values()} & kept
    report = json.loads((cleaned["out"] / "clean_report.json").read_text())
    steps = report["steps"]
    assert list(steps) == ["unknown_characters", "gopher_repetition", "gopher_quality", "c4_quality",
                           "fineweb_quality", "near_duplicates"]  # fmt: skip
    assert report["read"]["docs_out"] == cleaned["distinct"] + len(cleaned["pairs"]) + len(cleaned["noise"])
    assert report["read"]["skipped"] == {"malformed_json": 1}
    assert report["read"]["skipped_examples"]["malformed_json"] == [f"{cleaned['files'][0]}:6"]
    chain = [report["read"]["docs_out"], *(step["docs_in"] for step in steps.values())]
    outs = [report["read"]["docs_out"], *(step["docs_out"] for step in steps.values())]
    assert chain[1:] == outs[:-1], "each step takes in what the one before let out"
    assert report["output"]["docs"] == len(kept) == outs[-1]
    assert steps["near_duplicates"]["removed"]["near_duplicates"]["docs"] == len(cleaned["pairs"])
    assert report["duplicate_clusters"] == {"clusters": len(cleaned["pairs"]), "documents": 2 * len(cleaned["pairs"]),
                                            "by_size": {"2": len(cleaned["pairs"])}}  # fmt: skip
    garbled_bytes = cleaned["noise"]["garbled"][1]
    assert steps["unknown_characters"]["removed"] == {"unknown_characters": {"docs": 1, "bytes": garbled_bytes}}
    assert steps["gopher_repetition"]["examples"][0]["text"].startswith("Buy the best deals")
    removed = sum(entry["docs"] for step in steps.values() for entry in step["removed"].values())
    assert removed == report["read"]["docs_out"] - len(kept)
    assert steps["near_duplicates"]["share_of_corpus"]["docs"] == pytest.approx(len(cleaned["pairs"]) / chain[0])
    markdown = (cleaned["out"] / "clean_report.md").read_text()
    assert "| near_duplicates |" in markdown and "clusters by size: 12 of 2" in markdown
    assert not (cleaned["out"] / ".clean" / "filtered").exists(), "intermediates are removed once complete"
    again = run_clean(cleaned["files"], cleaned["out"])
    assert again.returncode == 0 and "already complete" in again.stdout


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, f"the run ended before {path} appeared: the kill would test nothing"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


@pytest.mark.multiprocess
def test_a_kill_at_any_moment_is_continued_by_the_same_command_to_the_same_output(cleaned, tmp_path):
    """The whole process tree killed inside the filter stage (frozen first while a second run into the same output is
    refused), the run's main process alone inside the MinHash signatures (its task processes must die with it), one
    task process alone inside the duplicate filter (the run must stop, not wait for it forever); the same command
    then runs to the end: the output and the report's counts are those of the uninterrupted run."""
    output = tmp_path / "out"
    for stage in ("filter", "signatures", "dedup"):
        command = clean_command(cleaned["files"], output)
        process = subprocess.Popen(command, cwd=REPO, env=LAUNCH_ENV, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
        wait_for(output / ".clean" / "stages" / stage / "logs" / "task_00000.log", process)
        if stage == "filter":
            tree = [process.pid, *(child.pid for child in psutil.Process(process.pid).children(recursive=True))]
            for pid in tree:
                os.kill(pid, signal.SIGSTOP)
            second = run_clean(cleaned["files"], output)
            assert second.returncode == 2 and "in use by another cleaning run" in second.stderr, second.stderr
        if stage == "signatures":  # only the run's own process, as a user's kill -9 does: its tasks must not go on
            tasks = psutil.Process(process.pid).children(recursive=True)
            process.kill()
            process.wait()
            assert tasks and not psutil.wait_procs(tasks, timeout=10)[1], "task processes outlived the killed run"
            continue
        if stage == "dedup":  # one task process only, as the OOM killer does: the run stops saying so, no hang,
            psutil.Process(process.pid).children()[0].kill()  # with 1, the code that says "run again" (it said 2)
            assert process.wait(timeout=60) == 1, "a killed task is not bad input: a scheduler must requeue the run"
            assert "a task process of stage dedup died" in process.stderr.read()
            continue
        assert kill_tree(process.pid) >= 2, "the run's task processes were not there to kill"
    result = run_clean(cleaned["files"], output)
    assert result.returncode == 0, result.stderr[-3000:]
    assert output_lines(output) == output_lines(cleaned["out"])
    expected, got = (json.loads((path / "clean_report.json").read_text()) for path in (cleaned["out"], output))
    assert got["steps"] == expected["steps"] and got["output"]["docs"] == expected["output"]["docs"]


def refusal(capsys, inputs: list[str], output: Path, *extra: str) -> str:
    """A refusal that comes before any work, from the command's main in this process: its one stderr line."""
    from data_prep.quality.cleaning.cli import main

    assert main(["--input", *inputs, "--output", str(output), *extra]) == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1 and "Traceback" not in error, error
    return error


@pytest.mark.multiprocess
def test_changed_settings_or_inputs_are_refused_naming_them(cleaned, tmp_path, capsys):
    config = tmp_path / "no_dedup.yaml"  # with a list argument: saved as JSON, it must still compare equal
    config.write_text("filters: {gopher_quality: {stop_words: [the, be, to, of, and]}}\ndedup: {enabled: false}\n")
    changed = refusal(capsys, cleaned["files"], cleaned["out"], "--config", str(config))
    assert "was started with other settings: " in changed and "config.dedup.enabled: true -> false" in changed
    assert "config.filters.fineweb_quality: {} -> off" in changed
    assert "strict: false -> true" in refusal(capsys, cleaned["files"], cleaned["out"], "--strict")
    copied = [shutil.copy(path, tmp_path) for path in cleaned["files"]]
    out = tmp_path / "out"
    assert run_clean(copied, out, "--config", str(config)).returncode == 0
    from data_prep.quality.cleaning.cli import main

    assert main(["--input", *copied, "--output", str(out), "--config", str(config)]) == 0
    assert "already complete" in capsys.readouterr().out
    with open(copied[0], "a") as handle:
        handle.write(json.dumps({"text": "one more"}) + "\n")
    assert f"--input {copied[0]} changed since" in refusal(capsys, copied, out, "--config", str(config))


@pytest.mark.multiprocess
def test_bad_input_is_one_line_before_work_or_skipped_and_counted(cleaned, tmp_path, capsys):
    truncated = tmp_path / "cut.jsonl.zst"
    data = Path(cleaned["files"][2]).read_bytes()
    truncated.write_bytes(data[: len(data) * 3 // 4])
    result = run_clean([str(truncated)], tmp_path / "out")
    assert result.returncode == 2 and str(truncated) in result.stderr and "--skip-corrupt-files" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = run_clean([str(truncated)], tmp_path / "kept", "--skip-corrupt-files")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "kept" / "clean_report.json").read_text())
    assert str(truncated) in report["read"]["corrupt_files"][0] and report["read"]["docs_out"] > 10
    result = run_clean([cleaned["files"][0]], tmp_path / "strict", "--strict")
    assert result.returncode == 2 and f"{cleaned['files'][0]}:6: malformed json (--strict)" in result.stderr
    assert "missing.jsonl does not exist" in refusal(capsys, [str(tmp_path / "missing.jsonl")], tmp_path / "none")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert "not a cleaning run's" in refusal(capsys, [cleaned["files"][0]], tmp_path / "taken")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    assert "must be positive" in refusal(capsys, cleaned["files"], tmp_path / "w", "--workers", "0")
    assert "needs --partition" in refusal(capsys, cleaned["files"], tmp_path / "s", "--executor", "slurm")


@pytest.mark.parametrize(
    "text, named",
    [
        ("filters: {gopher_qualty: {}}", "filters.gopher_qualty is not a filter"),
        ("filters: {gopher_quality: {min_words: 5}}", "filters.gopher_quality.min_words is not a setting"),
        (
            "filters: {unknown_characters: {max_share: 2}}",
            "filters.unknown_characters.max_share must be a number between 0 and 1, not 2",
        ),
        ("filters: {c4_badwords: {words_file: /nowhere/en}}", "filters.c4_badwords: [Errno 2]"),
        ("dedup: {num_buckets: 0}", "dedup.num_buckets must be a positive whole number"),
        (
            "filters: {fineweb_quality: {line_punct_thr: 1e-2}}",
            "line_punct_thr must be a number between 0 and 1, not '1e-2' (YAML reads 1e-2 as a string: write 0.01)",
        ),
        ("filters: {gopher_quality: {min_doc_words: true}}", "gopher_quality.min_doc_words must be a whole number"),
        ("dedup: {buckets: 4}", "dedup.buckets is not a setting"),
        ("language: klingon", "language 'klingon' has no word tokenizer"),
        ("filter: {}", "unknown key(s) ['filter']"),
        ("filters: [", "not valid YAML"),
        # issue 37: each of these kept 0 of 30 documents with exit 0, or ran what the file did not say
        (
            "filters: {gopher_quality: {max_doc_words: -3}}",
            "filters.gopher_quality.max_doc_words must be a whole number >= 0, not -3",
        ),
        (
            "filters: {gopher_repetition: {dup_line_frac: -1}}",
            "filters.gopher_repetition.dup_line_frac must be a number between 0 and 1, not -1",
        ),
        (
            "filters: {fineweb_quality: {line_punct_thr: 5}}",
            "filters.fineweb_quality.line_punct_thr must be a number between 0 and 1, not 5",
        ),
        (
            "filters: {gopher_quality: {min_doc_words: 50.5}}",
            "filters.gopher_quality.min_doc_words must be a whole number >= 0, not 50.5",
        ),
        (
            "filters: {gopher_quality: {max_doc_words: 30}}",
            "filters.gopher_quality.min_doc_words (50, its default) is "
            "more than filters.gopher_quality.max_doc_words (30)",
        ),
        (
            "filters: {gopher_quality: {min_avg_word_length: 12}}",
            "min_avg_word_length (12) is more than filters.gopher_quality.max_avg_word_length (10, its default)",
        ),
        (
            "filters: {gopher_repetition: {dup_n_grams: [[5, 1.5]]}}",
            "filters.gopher_repetition.dup_n_grams must be a list of [n, share] pairs",
        ),
        (
            "filters: {c4_quality: {max_word_length: 0}}",
            "filters.c4_quality.max_word_length must be -1 (off) or a whole number >= 1, not 0",
        ),
        ("filters: {c4_quality: {filter_policy: 1}}", "filters.c4_quality.filter_policy must be true or false, not 1"),
        (
            "filters: {fineweb_quality: {stop_chars: 5}}",
            "filters.fineweb_quality.stop_chars must be null or a list of strings",
        ),
        ("filters: {gopher_quality: {max_symbol_word_ratio: .nan}}", "max_symbol_word_ratio must be a number >= 0"),
        ("filters: {gopher_quality: {min_doc_words: null}}", "min_doc_words must be a whole number >= 0, not null"),
        ("filters: {}\ndedup:", "dedup is empty (null): write dedup: {} to run dedup with its defaults"),
        (
            "filters: {gopher_quality: null}",
            "filters.gopher_quality is empty (null): write {} for its defaults or false to turn it off",
        ),
        ("filters:\ndedup: {enabled: true}", "filters is empty (null): write filters: {} to run no quality filter"),
        ("dedup: {enabled: true}", "has no filters key"),
        ("", "is empty"),
        ("# every line commented out\n", "is empty"),
        ("filters: {gopher_quality: false}\ndedup: {enabled: false}", "no filter runs and dedup is off"),
    ],
)
def test_a_wrong_config_key_is_named(tmp_path, text, named):
    path = tmp_path / "clean.yaml"
    path.write_text(text)
    with pytest.raises(CleanConfigError, match=None) as error:
        load_clean_config(path)
    assert named in str(error.value) and str(path) in str(error.value), str(error.value)


def test_a_value_of_the_wrong_type_names_the_key_and_the_type_only(tmp_path):
    """`fifty` is not a number YAML misread: no hint about `1e-2`."""
    path = tmp_path / "clean.yaml"
    path.write_text("filters: {gopher_quality: {min_doc_words: fifty}}")
    with pytest.raises(CleanConfigError) as error:
        load_clean_config(path)
    assert str(error.value) == f"{path}: filters.gopher_quality.min_doc_words must be a whole number >= 0, not 'fifty'"


def test_every_filter_argument_has_a_rule_its_default_keeps_and_the_edges_are_exact(tmp_path):
    import inspect

    from data_prep.quality.cleaning.config import ARGUMENT_RULES, FILTER_CLASSES, NOT_SETTABLE, filter_class

    for name in FILTER_CLASSES:
        parameters = inspect.signature(filter_class(name).__init__).parameters
        settable = {key for key, parameter in parameters.items()
                    if key not in NOT_SETTABLE and parameter.kind is not parameter.VAR_KEYWORD}  # fmt: skip
        assert set(ARGUMENT_RULES[name]) == settable, f"{name}: every argument needs a rule, and only those"
        for key, rule in ARGUMENT_RULES[name].items():
            default = parameters[key].default
            if default is not inspect.Parameter.empty:
                assert rule.problem(default) is None, f"{name}.{key}: its default {default!r} breaks its rule"
    path = tmp_path / "clean.yaml"
    for arguments in ("{line_punct_thr: 0, short_line_thr: 1}", "{short_line_length: 0, new_line_ratio: 7.5}"):
        path.write_text(f"filters: {{fineweb_quality: {arguments}}}")
        load_clean_config(path)  # the ends of each range are in it
    path.write_text("filters: {gopher_quality: {min_doc_words: 60, max_doc_words: 60, min_avg_word_length: 2.5}, "
                    "c4_quality: {max_word_length: -1, min_num_sentences: -1}}")  # fmt: skip
    load_clean_config(path)


def test_the_shipped_config_loads_and_a_wrong_one_is_one_line_from_the_command(tmp_path, capsys):
    shipped = load_clean_config()
    assert [choice.name for choice in shipped.filters] == ["unknown_characters", "gopher_repetition", "gopher_quality",
                                                           "c4_quality", "fineweb_quality"]  # fmt: skip
    assert shipped.dedup.enabled and shipped.dedup.num_buckets * shipped.dedup.hashes_per_bucket == 120
    bad = tmp_path / "bad.yaml"
    bad.write_text("dedup: {n_grams: -1}")
    error = refusal(capsys, [str(tmp_path / "any.jsonl")], tmp_path / "out", "--config", str(bad))  # checked first
    assert error.strip() == f"error: {bad}: dedup.n_grams must be a positive whole number (got -1)"
    assert not (tmp_path / "out" / ".clean").exists(), "refused before any work"


def test_the_local_word_list_and_unknown_character_filters(tmp_path):
    from datatrove.data import Document

    from data_prep.quality.cleaning.steps import LocalBadWordsFilter, UnknownCharacterFilter

    words = tmp_path / "en"
    words.write_text("badword\nvery bad phrase\n")
    badwords = LocalBadWordsFilter(str(words))
    assert not badwords.filter(Document("this has a Very bad phrase in it".lower(), "1"))[0]
    assert badwords.filter(Document("this has a badwordish word", "2")) is True  # a refusal is a (truthy) tuple
    unknown = UnknownCharacterFilter(max_share=0.05)
    assert unknown.filter(Document("clean text " * 10, "3")) is True
    assert unknown.filter(Document("a\ufffd" + "b" * 40, "4")) is True  # 1 of 42 characters: under 5 %
    assert unknown.filter(Document("x\x00\x01" * 5, "5")) == (False, "unknown_characters")


@pytest.mark.multiprocess
def test_preprocessing_takes_the_output_as_it_is_and_its_report_links_the_cleaning(cleaned, corpus, tmp_path):
    from data_prep.preprocessing.pipeline import preprocess

    shards = sorted(str(path) for path in (cleaned["out"] / "data").glob("*.jsonl.zst"))
    manifest = preprocess(str(corpus["tokenizer"]), shards, str(tmp_path / "packed"), 64, 1, log=lambda *_: None)
    assert manifest["num_documents"] == len(output_lines(cleaned["out"])) and not any(manifest["skipped"].values())
    report = (tmp_path / "packed" / "data_report.md").read_text()
    assert "## Cleaning" in report and (cleaned["out"] / "clean_report.md").as_uri() in report
    assert "| near_duplicates |" in report


def test_a_stage_does_not_start_while_a_task_of_the_stages_before_it_is_unfinished(tmp_path):
    """What stops the stages after a failed task under Slurm, where datatrove chains the arrays of a stage of over
    1001 tasks with afterany."""
    from data_prep.quality.cleaning.stages import AfterStages

    completions = tmp_path / "stages" / "filter" / "completions"
    completions.mkdir(parents=True)
    (completions / "00000").touch()
    check = AfterStages(str(tmp_path), [("filter", 2)])
    with pytest.raises(RuntimeError, match=r"stage filter has unfinished tasks \[1\]"):
        check.run(None)
    (completions / "00001").touch()
    documents = iter(["document"])
    assert check.run(documents) is documents, "with every task before complete, the documents pass on untouched"


def _task(data, rank: int = 0, world_size: int = 1):
    """A stage's only step in the pool tests: nothing to do, except rank 1 of a failing stage, which fails."""
    if rank == 1 and os.environ.get("CLEAN_TEST_FAIL_RANK_1"):
        raise RuntimeError("rank 1 fails")
    return iter(())


def test_a_stage_leaves_no_pool_thread_to_race_the_interpreter_exit(tmp_path, monkeypatch):
    """A pool manager thread still closing its wake-up pipe when the interpreter exits races Python's exit hook
    writing to it: a successful run printed "OSError: [Errno 9] Bad file descriptor" (1 run in 40). Every stage,
    successful or failed, ends with its pool's threads ended."""
    import threading

    from datatrove.executor import LocalPipelineExecutor

    from data_prep.quality.cleaning.runner import run_stage

    def pool_threads() -> list:
        return [thread for thread in threading.enumerate() if type(thread).__name__ == "_ExecutorManagerThread"]

    for stage in range(3):
        run_stage(LocalPipelineExecutor([_task], tasks=3, logging_dir=str(tmp_path / f"ok{stage}")), 2)
        assert not pool_threads(), "the pool's manager thread outlived its stage"
    monkeypatch.setenv("CLEAN_TEST_FAIL_RANK_1", "1")
    with pytest.raises(RuntimeError, match="rank 1 fails"):
        run_stage(LocalPipelineExecutor([_task], tasks=3, logging_dir=str(tmp_path / "failing")), 2)
    assert not pool_threads(), "the pool's manager thread outlived its failed stage"

"""The cleaning command's exit codes, which a scheduler acts on (docs/data-cleaning.md, "Exit codes"): 1 for a task
that died or crashed (run it again), 2 for what a person must fix (an output that cannot be written, an output with
no document, an input inside the output), 4 for a full disk; and the report's count of the bytes C4 cut out of the
documents it kept. Found by a hostile pass over cleaning (issue 37)."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import resource
import subprocess
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from tests.conftest import LAUNCH_ENV, REPO
from tests.test_clean import clean_command, english_like, offline, output_lines, refusal, run_clean

DOC = REPO / "docs" / "data-cleaning.md"


def corpus_file(path: Path, documents: int, seed: int = 5) -> list[str]:
    """`documents` pages of English-like prose in one jsonl file (each passes every filter of the web preset, and no
    two are near-copies); returns their texts in order."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ten", "ra", "su", "vel", "dor", "pan", "qui", "ber", "sto", "fla", "gor", "nim"]
    vocabulary = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))) for _ in range(3000)})
    texts = [english_like(rng, vocabulary) for _ in range(documents)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return texts


def test_the_table_of_exit_codes_names_a_test_that_checks_each_code():
    section = DOC.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d) \| [^|]+ \| [^|]+ \| `(tests/[\w/.]+)::(\w+)` \|$", section, flags=re.M)
    assert [int(code) for code, *_ in rows] == [0, 1, 2, 4]
    import ast

    for code, path, name in rows:
        source = (REPO / path).read_text()
        functions = {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
                     if isinstance(node, ast.FunctionDef)}  # fmt: skip
        assert name in functions, f"{path}::{name} is named in the table but does not exist"
        assert re.search(rf"== {code}\b", functions[name]), f"{path}::{name} does not check exit code {code}"
    assert "data-cleaning.md#exit-codes" in (REPO / "docs" / "run-safety.md").read_text()


def test_each_way_a_stage_fails_gets_the_exit_code_a_scheduler_should_act_on(tmp_path):
    """A task process that died (the OOM killer) or a task that crashed: 1, run again. A full disk, quota or file-size
    limit: 4, make room first. An output that cannot be written, or a task's message about bad input: 2."""
    from data_prep.quality.cleaning.runner import stage_failure

    work = tmp_path / ".clean"
    died = stage_failure(BrokenProcessPool("gone"), "dedup", work)
    assert died.exit_code == 1 and "a task process of stage dedup died" in str(died)
    assert "run the same command again" in str(died)
    crashed = stage_failure(RuntimeError("boom"), "signatures", work)
    assert crashed.exit_code == 1 and "RuntimeError: boom" in str(crashed)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        full = stage_failure(OSError(code, os.strerror(code)), "filter", work)
        assert full.exit_code == 4 and f"--output {tmp_path}" in str(full) and "GB free" in str(full), str(full)
    wrapped = RuntimeError("zstd write failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert stage_failure(wrapped, "filter", work).exit_code == 4, "the cause is looked for along the chain"
    read_only = stage_failure(OSError(errno.EROFS, os.strerror(errno.EROFS), str(work / "x")), "filter", work)
    assert read_only.exit_code == 2 and "cannot write" in str(read_only)
    (work / "errors").mkdir(parents=True)
    (work / "errors" / "00000.txt").write_text("a.jsonl.zst: truncated archive")
    assert stage_failure(RuntimeError("x"), "filter", work).exit_code == 2


def test_squeue_that_does_not_answer_is_run_again_and_one_that_is_absent_is_for_a_person(tmp_path, monkeypatch):
    """A Slurm controller that times out is a moment's failure (1: requeue); no squeue on this host is the place's
    (2). Either way the command does not start a second run beside jobs that may still be writing."""
    from data_prep.quality.cleaning import runner

    (tmp_path / runner.SLURM_JOBS).write_text('["41"]')
    monkeypatch.setattr(runner.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(runner.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(
        command, 1, "", "slurm_load_jobs error: Socket timed out on send/recv operation"))  # fmt: skip
    with pytest.raises(runner.CleanError) as error:
        runner.live_slurm_jobs(tmp_path)
    assert error.value.exit_code == 1 and "Socket timed out" in str(error.value)

    def absent(command, **kwargs):
        raise FileNotFoundError(command[0])

    monkeypatch.setattr(runner.subprocess, "run", absent)
    with pytest.raises(runner.CleanError) as error:
        runner.live_slurm_jobs(tmp_path)
    assert error.value.exit_code == 2 and "squeue is not here" in str(error.value)


def test_an_output_that_cannot_be_written_is_one_line_exit_2_before_any_work(tmp_path, capsys, monkeypatch):
    """A path under a file (`--output /etc/passwd/x`), a file as the output, a read-only filesystem: each was a
    traceback and exit 1 (a scheduler would requeue it forever)."""
    source = tmp_path / "raw" / "a.jsonl"
    corpus_file(source, 2)
    in_the_way = tmp_path / "notes.txt"
    in_the_way.write_text("mine")
    error = refusal(capsys, [str(source)], in_the_way / "out")
    assert f"--output {in_the_way / 'out'}: cannot be created: {in_the_way} is a file" in error, error
    error = refusal(capsys, [str(source)], in_the_way)
    assert f"--output {in_the_way} is a file" in error and in_the_way.read_text() == "mine"

    real_mkdir, real_open = os.mkdir, os.open
    for code in (errno.EROFS, errno.EACCES):  # a read-only mount; a directory of another user's (root passes EACCES)
        place = tmp_path / errno.errorcode[code]  # every write under it fails as the kernel fails it

        def refuse(path, code=code, place=place):
            if str(path).startswith(str(place)):
                raise OSError(code, os.strerror(code), str(path))

        def mkdir(path, *args, refuse=refuse, **kwargs):
            refuse(path)
            return real_mkdir(path, *args, **kwargs)

        def open_(path, flags, *args, refuse=refuse, **kwargs):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                refuse(path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(os, "open", open_)
        error = refusal(capsys, [str(source)], place / "out")
        assert f"--output {place / 'out'}: cannot be created ({os.strerror(code)})" in error, error
        real_mkdir(place)
        real_mkdir(place / "out")  # there already, as on a mount made read-only after a first run
        error = refusal(capsys, [str(source)], place / "out")
        assert f"--output {place / 'out'}: cannot write" in error and f"({os.strerror(code)})" in error, error
        monkeypatch.undo()


@pytest.mark.multiprocess
def test_a_full_disk_exits_4_naming_the_free_space_and_the_same_command_finishes_after_it(tmp_path):
    """A file-size limit of 64 kB makes the first shard over it fail as a full disk fails (EFBIG, as ENOSPC). It
    exited 2, "bad input": the input is not at fault, and a rerun without room fails again, so a person must make room
    (exit 4, docs/data-cleaning.md). Then the same command continues to the whole output."""
    texts = corpus_file(tmp_path / "raw" / "big.jsonl", 200)  # ~110 kB compressed after the filters; logs < 30 kB
    command = offline(clean_command([str(tmp_path / "raw" / "big.jsonl")], tmp_path / "out"))

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    full = subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=300,
                          preexec_fn=limit_file_size)  # fmt: skip
    assert full.returncode == 4, full.stderr[-3000:]
    assert full.stderr.startswith(f"error: --output {tmp_path / 'out'}: File too large") and "GB free" in full.stderr
    assert "Traceback" not in full.stderr and len(full.stderr.strip().splitlines()) == 1, full.stderr
    again = subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [record["text"] for record in output_lines(tmp_path / "out")] == texts


@pytest.mark.multiprocess
def test_an_output_with_no_document_is_an_error_naming_why(tmp_path):
    """200 kB of random bytes, an empty file, and documents every one of which a filter removes: each ended with
    exit 0, `0 kept` and no word. Now exit 2 with a last line that says why (the skipped records, or the filter and
    its reason), the report written (with the same line among its warnings), and a rerun says it again."""
    random_bytes = tmp_path / "random.jsonl"
    random_bytes.write_bytes(random.Random(1).randbytes(200_000))
    result = run_clean([str(random_bytes)], tmp_path / "random")
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the output holds no document: the input yielded none (") and "Traceback" not in \
        result.stderr, result.stderr  # fmt: skip
    assert "invalid_utf8" in last and f"{random_bytes}:1" in last and "--text-field text" in last, last
    report = json.loads((tmp_path / "random" / "clean_report.json").read_text())
    assert report["output"]["docs"] == 0 and f"error: {report['warnings'][0]}" == last
    again = run_clean([str(random_bytes)], tmp_path / "random")
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1] == last, again.stderr

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = run_clean([str(empty)], tmp_path / "empty")
    assert result.returncode == 2 and "the input yielded none (1 file(s), 0 records skipped)" in result.stderr

    corpus_file(tmp_path / "raw" / "a.jsonl", 6)
    config = tmp_path / "strict.yaml"
    config.write_text("filters: {gopher_quality: {min_stop_words: 1000}}\n")
    result = run_clean([str(tmp_path / "raw" / "a.jsonl")], tmp_path / "filtered", "--config", str(config))
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the output holds no document: all 6 documents read were removed, most by "
                           "gopher_quality (6, most for gopher_enough_stop_words)"), last  # fmt: skip
    assert "filters.gopher_quality.min_stop_words" in last


def test_an_input_pattern_that_matches_the_output_is_refused_naming_it(tmp_path, capsys):
    """A rerun of `--input 'raw/*' --output raw/cleaned` matched its own output and was refused as "does not exist
    or is not a file"."""
    raw = tmp_path / "raw"
    corpus_file(raw / "a.jsonl", 2)
    (raw / "cleaned" / "data").mkdir(parents=True)  # as a first run leaves it
    (raw / "cleaned" / "data" / "00000.jsonl.zst").write_bytes(b"")
    error = refusal(capsys, [str(raw / "*")], raw / "cleaned")
    assert f"--input {raw / '*'} matches {raw / 'cleaned'}, inside --output {raw / 'cleaned'}" in error, error
    error = refusal(capsys, [str(raw / "*.jsonl"), str(raw / "*" / "*" / "*.zst")], raw / "cleaned")
    assert f"matches {raw / 'cleaned' / 'data' / '00000.jsonl.zst'}, inside --output" in error, error
    error = refusal(capsys, [str(raw / "cleaned" / "data" / "00000.jsonl.zst")], raw / "cleaned")
    assert "inside --output" in error


def test_the_report_counts_the_bytes_c4_cut_from_the_documents_it_kept(tmp_path):
    """C4's filter drops short lines from a document and keeps the rest: those bytes are neither a removed document
    nor kept. The report had no field for them."""
    from data_prep.quality.cleaning.config import CleanConfig, DedupConfig, FilterChoice
    from data_prep.quality.cleaning.report import build_report
    from data_prep.quality.cleaning.stages import CleanJob
    from data_prep.quality.cleaning.steps import Audited, CorpusReader

    sentences = " ".join(f"This is sentence number {n} of the page." for n in range(6))
    kept = f"Home\nMenu\n{sentences}"  # C4: "Home" and "Menu" have fewer than 3 words
    dropped = "Nothing here but {braces} and short words. " * 6  # C4: a `{` drops the whole page
    source = tmp_path / "a.jsonl"
    source.write_text(json.dumps({"text": kept}) + "\n" + json.dumps({"text": dropped}) + "\n")
    config = CleanConfig(filters=(FilterChoice("c4_quality", {}),), dedup=DedupConfig(enabled=False))
    job = CleanJob(str(tmp_path / "out"), (str(source),), config, 1, preset=None)
    reader = CorpusReader([str(source)], "text", False, False, str(job.work))
    c4 = Audited("c4_quality", config.filters[0].build("eng"), str(job.work), False)
    documents = list(c4.run(reader.run()))
    assert [document.text for document in documents] == [sentences]
    step = build_report(job, [])["steps"]["c4_quality"]
    assert step["bytes_cut_from_kept"] == len("Home\nMenu\n")
    assert step["removed"] == {"curly_bracket": {"docs": 1, "bytes": len(dropped)}}
    assert step["bytes_in"] - step["bytes_out"] == step["removed"]["curly_bracket"]["bytes"] + len("Home\nMenu\n")

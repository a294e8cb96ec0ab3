"""Every command's exit codes, as docs/run-safety.md's table of them says (issue 37.4): 0 done, 1 run the same command
again (a worker process died), 2 bad input, 4 a full disk, each failure in one `error:` line and never a traceback.
Each command runs as a user starts it (`python -m ...`); a full disk is a file-size limit (RLIMIT_FSIZE, which fails a
write with EFBIG as a full disk fails it with ENOSPC). The table's cells that name another file's test are checked
here to exist and to check their code."""

from __future__ import annotations

import ast
import gzip
import json
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from common.exit_codes import BAD_INPUT, DISK_FULL, DONE, RETRY
from data_prep.reading.readers import iter_texts
from tests.conftest import LAUNCH_ENV, REPO, TINY_RECIPE, kill_whole_tree

SEQ = 64
CODES = {"DONE": DONE, "RETRY": RETRY, "BAD_INPUT": BAD_INPUT, "DISK_FULL": DISK_FULL}


def run(module: str, *args, file_size_limit: int | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m module args`, as a user starts it; with `file_size_limit` bytes, a write past it fails (EFBIG)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    command = [sys.executable, "-m", module, *map(str, args)]
    return subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, text=True, capture_output=True, timeout=timeout,
                          preexec_fn=limit if file_size_limit else None)  # fmt: skip


def one_line(result: subprocess.CompletedProcess, code: int, *named: str) -> str:
    """`result` exited `code` with one line on stderr, `error: ...`, naming each of `named`; no traceback."""
    assert result.returncode == code, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert all(text in lines[0] for text in named), lines[0]
    return lines[0]


def last_line(result: subprocess.CompletedProcess, code: int, *named: str) -> str:
    """As `one_line`, for a command whose libraries draw progress bars on stderr first (DeepSpeed's, lm-eval's): the
    one `error:` line is the last, and there is no traceback."""
    assert result.returncode == code, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and [line for line in lines if line.startswith("error: ")] == lines[-1:]
    assert all(text in lines[-1] for text in named), lines[-1]
    return lines[-1]


def disk_full_said(output: Path) -> tuple[str, ...]:
    """What the line of a DISK_FULL exit names: the output, the error, the free space, and the same command again."""
    return f"--output {output}: File too large", "GB free", "run the same command again"


MISSING = "the following arguments are required: "


@pytest.mark.parametrize(
    ("module", "args", "said"),
    [
        ("data_prep.preprocess", ["--tokenizer", "t"], MISSING),
        ("data_prep.preprocess", ["--tokenizer", "t", "--input", "a", "--output", "o", "--seq-len", "x"],
         "argument --seq-len: invalid int value: 'x'"),
        ("data_prep.merge", ["part-0"], MISSING),
        ("data_prep.train_tokenizer", ["--input", "a.jsonl"], MISSING),
        ("recipes.export", ["checkpoint-40"], MISSING),
        ("eval.run", ["--model", "final"], MISSING),
        ("recipes.attention_check", [], MISSING),
        ("recipes.plan", [], MISSING),
        ("data_prep.clean", ["--input", "a.jsonl", "--workers", "x"], "argument --workers: invalid int value: 'x'"),
    ],
)  # fmt: skip
def test_a_mistake_on_the_command_line_is_one_line(module, args, said):
    """argparse printed its whole usage (2 to 15 lines) before the mistake."""
    one_line(run(module, *args), BAD_INPUT, said)


def killed_worker(command: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run `command` and SIGKILL its first tokenizer worker process as soon as it exists (as the OOM killer would):
    the run cannot end before it, since the worker has a chunk to tokenize that nothing else takes."""
    process = subprocess.Popen(command, cwd=REPO, env=LAUNCH_ENV, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    deadline, killed = time.monotonic() + timeout_s, False
    try:
        while not killed and process.poll() is None and time.monotonic() < deadline:
            for child in psutil.Process(process.pid).children():
                try:
                    if "spawn_main" in " ".join(child.cmdline()):
                        child.kill()
                        killed = True
                        break
                except psutil.Error:
                    pass
            time.sleep(0.005)
        stdout, stderr = process.communicate(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        kill_whole_tree(process.pid)
        stdout, stderr = process.communicate()
        raise AssertionError(f"still running {timeout_s} s after a worker was killed: a hang") from None
    assert killed, f"no worker process was seen: {stderr[-2000:]}"
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def preprocess_command(corpus, source, out, *extra) -> list[str]:
    return [sys.executable, "-m", "data_prep.preprocess", "--tokenizer", str(corpus["tokenizer"]), "--input",
            str(source), "--output", str(out), "--seq-len", str(SEQ), "--rows-per-shard", "50", *extra]  # fmt: skip


def test_preprocess_a_killed_worker_exits_1_and_the_same_command_finishes(corpus, tmp_path):
    """multiprocessing.Pool replaced a killed worker and waited forever for the chunk it held (or, killed before it
    took one, went on: exit 0): a scheduler saw a hang, not a failure to requeue."""
    out = tmp_path / "out"
    command = preprocess_command(corpus, corpus["validation"], out, "--num-workers", "2")
    died = killed_worker(command)
    one_line(died, RETRY, "a tokenizer worker process died", "run the same command again")
    assert not (out / "manifest.json").exists()
    again = subprocess.run(command, cwd=REPO, env=LAUNCH_ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == DONE, again.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_documents"] == sum(1 for _ in iter_texts(corpus["validation"]))


def test_preprocess_an_output_it_cannot_make_is_one_line_before_any_work(corpus, tmp_path):
    """A file in the way of --output was a traceback from the lock's mkdir (exit 1: a scheduler requeued it)."""
    in_the_way = tmp_path / "notes.txt"
    in_the_way.write_text("mine")
    for output, said in ((in_the_way / "out", f"cannot be created: {in_the_way} is a file"), (in_the_way, "is a file")):
        result = run("data_prep.preprocess", *preprocess_command(corpus, corpus["validation"], output)[3:])
        one_line(result, BAD_INPUT, f"--output {output} {said}")
    assert in_the_way.read_text() == "mine"


@pytest.fixture(scope="module")
def parts(tmp_path_factory, corpus) -> list[Path]:
    """The two parts of a small preprocessing split over two machines."""
    from data_prep.preprocessing.pipeline import preprocess

    root = tmp_path_factory.mktemp("parts")
    texts = list(iter_texts(corpus["validation"]))
    inputs = [root / "a.jsonl", root / "b.jsonl"]
    for index, path in enumerate(inputs):
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts[index::2]))
    for part in range(2):
        preprocess(str(corpus["tokenizer"]), list(map(str, inputs)), str(root / f"part-{part}"), SEQ, 1,
                   rows_per_shard=50, num_parts=2, part=part, log=lambda line: None)  # fmt: skip
    return [root / "part-0", root / "part-1"]


def test_merge_refuses_a_damaged_or_foreign_part_and_an_output_it_cannot_make_in_one_line(parts, tmp_path):
    """Each was a traceback and exit 1 (JSONDecodeError, KeyError, FileExistsError)."""
    damaged, foreign = tmp_path / "damaged", tmp_path / "checkpoint-40"
    shutil.copytree(parts[1], damaged)
    (damaged / "manifest.json").write_text('{"settings": {"part": {"ind')  # cut short by a full disk, say
    foreign.mkdir()
    (foreign / "manifest.json").write_text(json.dumps({"step": 40, "files": {}}))  # a training checkpoint's
    for part, said in ((damaged, "not valid JSON"), (foreign, "KeyError: 'settings'")):
        result = run("data_prep.merge", parts[0], part, "--output", tmp_path / "merged")
        one_line(result, BAD_INPUT, f"{part / 'manifest.json'} is not a preprocessing part's manifest", said)
    in_the_way = tmp_path / "notes.txt"
    in_the_way.write_text("mine")
    result = run("data_prep.merge", *parts, "--output", in_the_way / "merged")
    one_line(result, BAD_INPUT, f"--output {in_the_way / 'merged'} cannot be created: {in_the_way} is a file")
    assert not (tmp_path / "merged").exists()


def test_merge_on_a_full_disk_exits_4_and_the_same_command_merges_after_it(parts, tmp_path):
    """It was a traceback from the data report's PNG and exit 1."""
    out = tmp_path / "merged"
    one_line(run("data_prep.merge", *parts, "--output", out, file_size_limit=4096), DISK_FULL, *disk_full_said(out))
    assert not (out / "manifest.json").exists(), "not complete, so never read as a corpus"
    again = run("data_prep.merge", *parts, "--output", out)
    assert again.returncode == DONE, again.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    counts = [json.loads((part / "manifest.json").read_text())["num_documents"] for part in parts]
    assert manifest["num_documents"] == sum(counts)


def test_train_tokenizer_refuses_a_damaged_input_and_an_output_it_cannot_make_in_one_line(corpus, tmp_path):
    """Each was a traceback and exit 1: the damage is found while training reads, the output when it saves."""
    damaged = tmp_path / "corpus.jsonl.gz"
    damaged.write_bytes(gzip.compress(corpus["validation"].read_bytes())[:5000])
    result = run("data_prep.train_tokenizer", "--input", damaged, "--vocab-size", 300, "--output", tmp_path / "tok")
    one_line(result, BAD_INPUT, f"--input: {damaged}: truncated or corrupt")
    in_the_way = tmp_path / "notes.txt"
    in_the_way.write_text("mine")
    result = run("data_prep.train_tokenizer", "--input", corpus["validation"], "--vocab-size", 300, "--output",
                 in_the_way / "tok")  # fmt: skip
    one_line(result, BAD_INPUT, f"--output {in_the_way / 'tok'} cannot be created: {in_the_way} is a file")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["corpus.jsonl.gz", "notes.txt"]
    # a wrong --text-field saved a 258-token tokenizer with exit 0; a parquet without the column, a hub name: tracebacks
    result = run("data_prep.train_tokenizer", "--input", corpus["validation"], "--vocab-size", 300, "--output",
                 tmp_path / "tok", "--text-field", "body")  # fmt: skip
    one_line(result, BAD_INPUT, "--input: no document was read (read 0 documents, skipped missing_field")
    assert "is the text under another field than --text-field body?" in result.stderr
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    for source, said in ((tmp_path / "b.parquet", "no column 'text'"), ("someorg/somecorpus", "does not exist")):
        result = run("data_prep.train_tokenizer", "--input", source, "--vocab-size", 300, "--output", tmp_path / "t")
        one_line(result, BAD_INPUT, said)
    assert not (tmp_path / "tok").exists() and not (tmp_path / "t").exists()
    result = run("data_prep.train_tokenizer", "--input", corpus["validation"], "--vocab-size", 300, "--output",
                 tmp_path / "tok")  # fmt: skip
    assert result.returncode == 0 and "read " in result.stdout and "documents" in result.stdout, result.stderr


def test_train_tokenizer_on_a_full_disk_exits_4_leaves_nothing_and_the_same_command_saves_after_it(corpus, tmp_path):
    """It was a traceback and exit 1 (tokenizers raises a plain Exception, "File too large (os error 27)"), and the
    half-written staging directory stayed."""
    out = tmp_path / "tokenizer"
    command = ("data_prep.train_tokenizer", "--input", corpus["validation"], "--vocab-size", 300, "--output", out)
    one_line(run(*command, file_size_limit=4096), DISK_FULL, *disk_full_said(out))
    assert list(tmp_path.iterdir()) == [], "no tokenizer, and no staging directory beside it"
    again = run(*command)
    assert again.returncode == DONE, again.stderr[-3000:]
    assert (out / "tokenizer.json").is_file()


@pytest.mark.multiprocess  # the session's trained run
def test_export_on_a_full_disk_exits_4_and_publishes_nothing(trained_run, tmp_path):
    """safetensors' own error (SafetensorError, "File too large (os error 27)") was a traceback and exit 1."""
    out = tmp_path / "model"
    result = run("recipes.export", trained_run["dir"] / "checkpoint-40", "--output", out, file_size_limit=65536)
    last_line(result, DISK_FULL, *disk_full_said(out))
    assert list(tmp_path.iterdir()) == [], "nothing published, no staging left"


def test_eval_run_refuses_a_model_directory_without_weights_in_one_line(corpus, tmp_path):
    """transformers' OSError was a traceback and exit 1, after the benchmark data had been read."""
    model = tmp_path / "model"
    shutil.copytree(corpus["tokenizer"], model)
    (model / "config.json").write_text("{}")
    result = run("eval.run", "--model", model, "--tasks", "mmlu", "--output", tmp_path / "results.json")
    one_line(result, BAD_INPUT, f"--model {model}: no weights there")


@pytest.mark.multiprocess  # the session's trained run
def test_eval_run_on_a_full_disk_exits_4_with_the_scores_printed_and_no_file_left(trained_run, tmp_path):
    """The results file failing at the end of an evaluation was a traceback and exit 1, and left .results.json.tmp."""
    from eval import fixtures

    data = fixtures.write(tmp_path / "data")
    out = tmp_path / "results" / "results.json"
    result = run("eval.run", "--model", trained_run["dir"] / "final", "--tasks", "gsm8k", "--gsm8k-dir",
                 data["gsm8k_jsonl"], "--limit", 1, "--num-fewshot", 0, "--max-gen-toks", 4, "--device", "cpu",
                 "--output", out, file_size_limit=4096)  # fmt: skip
    last_line(result, DISK_FULL, *disk_full_said(out))
    assert "gsm8k_local" in result.stdout, "the scores are in the log"
    assert list(out.parent.iterdir()) == [], "no results file, whole or partial"


def test_attention_check_bad_input_is_one_line():
    result = run("recipes.attention_check", "--config", "recipes/configs/tiny_cpu.yaml", "--num-layers", 0)
    one_line(result, BAD_INPUT, "--num-layers 0: give 1 or more layers")


def test_a_failed_attention_check_is_not_a_failure_to_retry(monkeypatch, capsys, corpus):
    """It exited 1, the code a scheduler requeues on, for a verdict that is the same every time: a person changes
    the recipe or the environment (2), and the line says what failed."""
    import recipes.attention_check as attention_check

    monkeypatch.setattr(attention_check, "packed_against_alone", lambda *args: (0.0, 5))  # documents never meet
    code = attention_check.main(["--config", str(TINY_RECIPE), "--tokenizer_name_or_path",
                                 str(corpus["tokenizer"]), "--document_masking", "false"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == BAD_INPUT and json.loads(captured.out)["ok"] is False
    said = captured.err.strip().splitlines()[-1]
    assert said.startswith(f"error: --config {TINY_RECIPE}: the check failed: documents see each other (no "
                           "masking) was expected"), said  # fmt: skip
    assert "choose another attn_implementation" in said


def test_plan_bad_input_is_one_line():
    result = run("recipes.plan", "--config", "recipes/configs/llama70b_a800x8.yaml", "--gpus", 0)
    one_line(result, BAD_INPUT, "--gpus 0: must be a whole number of at least 1")


def exit_code_table() -> dict[str, dict[int, list[str]]]:
    """docs/run-safety.md's table: {command: {code: [tests that produce it]}} (no test: the command never exits so)."""
    text = (REPO / "docs" / "run-safety.md").read_text()
    section = text.split("**Exit codes of every command**", 1)[1].split("\n\n", 2)[1]
    header, _, *rows = section.strip().splitlines()
    codes = [int(code) for code in re.findall(r"\| (\d) ", header)]
    table = {}
    for row in rows:
        command, *cells = [cell.strip() for cell in row.strip("|").split("|")]
        tests = [re.findall(r"`(tests/[\w/.]+::\w+)`", cell) for cell in cells]
        table[command] = dict(zip(codes, tests, strict=True))
    return table


def test_the_table_names_for_every_command_a_test_that_checks_each_code_it_gives():
    table = exit_code_table()
    commands = ["data_prep.clean", "data_prep.preprocess", "data_prep.merge", "recipes.export", "eval.run",
                "data_prep.train_tokenizer", "recipes.attention_check", "recipes.plan"]  # fmt: skip
    assert [command.removeprefix("`python -m ").removesuffix("`") for command in table] == commands, list(table)
    assert list(next(iter(table.values()))) == [DONE, RETRY, BAD_INPUT, DISK_FULL]
    for command, by_code in table.items():
        assert by_code[DONE] and by_code[BAD_INPUT], f"{command}: every command finishes, and refuses bad input"
        for code, tests in by_code.items():
            for test in tests:
                path, name = test.split("::")
                source = (REPO / path).read_text()
                functions = {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
                             if isinstance(node, ast.FunctionDef)}  # fmt: skip
                assert name in functions, f"{test} is named in the table but does not exist"
                names = [constant for constant, value in CODES.items() if value == code]
                assert re.search(rf"== {code}\b|\b{names[0]}\b", functions[name]), f"{test} does not check {code}"


def test_cleaning_gives_the_same_numbers_the_other_commands_name():
    from data_prep.quality.cleaning.runner import CleanCrashed, CleanError, OutputFull

    assert (CleanError.exit_code, CleanCrashed.exit_code, OutputFull.exit_code) == (BAD_INPUT, RETRY, DISK_FULL)


def test_a_bad_input_found_on_another_node_is_said_by_that_nodes_first_rank(tmp_path):
    """A check that fails on one node only (a mount missing there, fewer GPUs) was said by no one: only global rank 0
    printed, and the log held just the launcher's exit 2. Every node's first rank says it, naming its host."""
    import socket

    said = {}
    for rank, local_rank in ((0, 0), (9, 1), (8, 0)):
        env = {**LAUNCH_ENV, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
        done = subprocess.run([sys.executable, "recipes/pretrain.py", "--config", str(tmp_path / "missing.yaml")],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2, done.stderr
        said[rank] = done.stderr
    assert said[0].startswith("error: ") and said[0].count("\n") == 1 and "missing.yaml" in said[0], said[0]
    assert said[8] == f"{said[0].rstrip()} (on {socket.gethostname()}, rank 8)\n"
    assert said[9] == ""


def test_a_full_disk_anywhere_in_a_run_is_a_failed_save():
    """final/'s export out of space came out as bad input (2: a scheduler does not requeue it, a person looks for a
    mistake in the recipe), and a full disk writing metrics.jsonl or the report as a traceback (1). Both are 4 now,
    with one line; the other errors keep their codes, and one the run does not name stays a traceback."""
    import errno

    from recipes.config import ConfigError
    from recipes.training.checkpointing import CheckpointSaveError
    from recipes.training.exit_codes import run_exit
    from recipes.training.run_state import TrainingFault
    from recipes.training.train_data import DataStallError

    def chained(outer: Exception, inner: Exception) -> Exception:
        try:
            try:
                raise inner
            except OSError:
                raise outer from None
        except Exception as error:  # noqa: BLE001 (the chain is what is tested)
            return error

    full = OSError(errno.ENOSPC, "No space left on device", "/runs/a/final/.tmp/model.safetensors")
    export_full = chained(ConfigError("cannot export checkpoint-40: No space left on device"), full)
    assert run_exit(export_full, "/runs/a") == (4, "cannot export checkpoint-40: No space left on device")
    code, said = run_exit(OSError(errno.ENOSPC, "No space left on device", "/runs/a/metrics.jsonl"), "/runs/a")
    assert code == 4 and said.startswith("output_dir /runs/a: No space left on device while writing /runs/a/metrics")
    assert run_exit(ConfigError("train_files: the data ended"), "/runs/a") == (2, "train_files: the data ended")
    assert run_exit(TrainingFault("non-finite loss"), "/runs/a")[0] == 3
    assert run_exit(CheckpointSaveError("saving failed"), "/runs/a")[0] == 4
    assert run_exit(DataStallError("stuck"), "/runs/a")[0] == 5
    assert run_exit(ValueError("a bug"), "/runs/a") is None and run_exit(OSError(errno.EIO, "I/O"), "/runs/a") is None

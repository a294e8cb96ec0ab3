"""Preprocessed outputs written before `data_prep/` was regrouped by role (commit 98a8a43, the last with every module
side by side) still serve this code: training reads them row for row as it reads its own, the same command finds them
complete (their settings, the tokenizer pin and the normalization version of `--dedup` included), and merge takes an
old part beside a new one. The old code is taken from the repository's own history, so nothing is stored here."""

import json
import subprocess
import sys

import pytest
import torch

from common.files import sha256_of
from data_prep.packing.packed_dataset import PackedRows
from data_prep.parts.merge import merge
from data_prep.reading.readers import iter_texts
from data_prep.tokenizer.loading import load_tokenizer
from tests.conftest import LAUNCH_ENV, REPO, old_tree

BEFORE_DATA_PREP_REGROUPING = "98a8a43"
SEQ = 64


def preprocess_command(corpus, inputs, output, *extra) -> list[str]:
    return [sys.executable, "-m", "data_prep.preprocess", "--tokenizer", str(corpus["tokenizer"]), "--input",
            *map(str, inputs), "--output", str(output), "--seq-len", str(SEQ), "--num-workers", "1",
            "--rows-per-shard", "40", "--dedup", *extra]  # fmt: skip


def run(command: list[str], tree) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=tree, env={**LAUNCH_ENV, "PYTHONPATH": str(tree)}, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, corpus):
    """The same input preprocessed whole and as part 0 of 2 by the old code and by this code, and as part 1 by this
    code."""
    root = tmp_path_factory.mktemp("data-compatibility")
    texts = list(iter_texts(corpus["train"]))
    inputs = []
    for index in range(3):
        inputs.append(root / f"input-{index}.jsonl")
        inputs[-1].write_text("".join(json.dumps({"text": text}) + "\n" for text in texts[index::3] + texts[:5]))
    old = old_tree(tmp_path_factory, BEFORE_DATA_PREP_REGROUPING)
    assert (old / "data_prep/pipeline.py").exists() and not (old / "data_prep/preprocessing").exists()
    run(preprocess_command(corpus, inputs, root / "old-whole"), old)
    run(preprocess_command(corpus, inputs, root / "old-part-0", "--num-parts", "2", "--part", "0"), old)
    run(preprocess_command(corpus, inputs, root / "new-whole"), REPO)
    run(preprocess_command(corpus, inputs, root / "new-part-0", "--num-parts", "2", "--part", "0"), REPO)
    run(preprocess_command(corpus, inputs, root / "new-part-1", "--num-parts", "2", "--part", "1"), REPO)
    return root, inputs


def test_training_reads_an_old_output_row_for_row_as_a_new_one(outputs, corpus):
    root, _ = outputs
    old, new = PackedRows(root / "old-whole"), PackedRows(root / "new-whole")
    assert len(old) == len(new) > 40, "more than one shard"
    assert all(torch.equal(old[i]["input_ids"], new[i]["input_ids"]) for i in range(len(new)))
    old.check_matches(load_tokenizer(corpus["tokenizer"], "tokenizer"), str(corpus["tokenizer"]), SEQ)
    assert old.manifest["settings"] == new.manifest["settings"], "dedup with the same normalization included"


def test_the_same_command_finds_an_old_output_complete_and_leaves_it(outputs, corpus):
    root, inputs = outputs
    before = {path: sha256_of(path) for path in sorted((root / "old-whole").rglob("*")) if path.is_file()}
    result = run(preprocess_command(corpus, inputs, root / "old-whole"), REPO)
    assert "already complete (same settings); nothing to do" in result.stdout + result.stderr
    assert {path: sha256_of(path) for path in sorted((root / "old-whole").rglob("*")) if path.is_file()} == before


def test_an_old_part_merges_with_a_new_part_as_two_new_parts_do(outputs):
    root, _ = outputs
    mixed = merge([str(root / "old-part-0"), str(root / "new-part-1")], str(root / "merged-mixed"))
    new = merge([str(root / "new-part-0"), str(root / "new-part-1")], str(root / "merged-new"))
    assert len(new["shards"]) > 1 and [shard["sha256"] for shard in mixed["shards"]] == [
        shard["sha256"] for shard in new["shards"]
    ]
    assert mixed["num_documents"] == new["num_documents"] and mixed["settings"] == new["settings"]

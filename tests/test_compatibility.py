"""Checkpoints written by earlier code resume bit-exactly with this code: from before the Trainer restructuring
(commit f7f6868: data position in the manifest and trainer_state.json, no run_identity.json) and from before
`recipes/` was regrouped by role (commit 379b0f4). The old code is taken from the repository's own history, so
nothing is stored here."""

import shutil
import subprocess
import sys

import pytest

from tests.conftest import (
    CPU_ACCELERATE_CONFIG,
    LAUNCH_ENV,
    REPO,
    free_port,
    launch,
    old_tree,
    tiny_overrides,
    train_losses,
)

pytestmark = pytest.mark.multiprocess

BEFORE_RESTRUCTURING = "f7f6868"
BEFORE_REGROUPING = "379b0f4"


@pytest.mark.parametrize("commit", [BEFORE_RESTRUCTURING, BEFORE_REGROUPING])
def test_a_checkpoint_of_the_old_code_resumes_bit_exactly(tmp_path, tmp_path_factory, corpus, commit):
    old_tree_ = old_tree(tmp_path_factory, commit)
    args = tiny_overrides(corpus, tmp_path / "old", max_steps=4, save_steps=2, logging_steps=1, eval_steps=100,
                          warmup_steps=2)  # fmt: skip
    # the old code with its own recipe (it knows no key added since; zero3_leaf_modules is one: its checkpoints were
    # written with every module hooked, and resume with leaf layers below)
    old_args = ["--config", str(old_tree_ / "recipes/configs/tiny_cpu.yaml"), *args[2:]]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_ACCELERATE_CONFIG),
               "--num_processes", "2", "--main_process_port", str(free_port()), str(old_tree_ / "recipes/pretrain.py"),
               *old_args]  # fmt: skip
    old = subprocess.run(command, cwd=old_tree_, env={**LAUNCH_ENV, "PYTHONPATH": str(old_tree_)}, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert old.returncode == 0, old.stderr[-4000:]
    if commit == BEFORE_RESTRUCTURING:
        assert not (tmp_path / "old" / "checkpoint-2" / "run_identity.json").exists(), "written by the old code"

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "old", resumed_dir, ignore=shutil.ignore_patterns("checkpoint-4", "final"))
    (resumed_dir / "latest").write_text("checkpoint-2\n")
    # the tiny recipe's positions went 1024 -> 4096 since (room for real 5-shot prompts): a run-defining value, which
    # the resume refuses to change under a run, so it resumes with the checkpoint's, as that refusal says
    positions = ["--model_config.max_position_embeddings", "1024"]
    resumed = launch(REPO / "recipes/pretrain.py", [*args, *positions, "--output_dir", str(resumed_dir)])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "checkpoint-2 at step 2" in resumed.stderr and "LlamaDecoderLayer gathered whole" in resumed.stderr
    assert train_losses(resumed_dir) == train_losses(tmp_path / "old")
    assert sorted(train_losses(resumed_dir)) == [1, 2, 3, 4]

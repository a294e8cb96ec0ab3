"""A checkpoint written before the Trainer restructuring (commit f7f6868: data position in the manifest and
trainer_state.json, no run_identity.json) resumes bit-exactly with this code. The old code is taken from the
repository's own history, so nothing is stored here."""

import shutil
import subprocess
import sys

import pytest

from tests.conftest import CPU_ACCELERATE_CONFIG, LAUNCH_ENV, REPO, free_port, launch, tiny_overrides, train_losses

pytestmark = pytest.mark.multiprocess

BEFORE_RESTRUCTURING = "f7f6868"


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory):
    tree = tmp_path_factory.mktemp("f7f6868")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", BEFORE_RESTRUCTURING], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {BEFORE_RESTRUCTURING} is not in this clone's history (shallow clone?)")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def test_a_checkpoint_of_the_old_code_resumes_bit_exactly(tmp_path, old_tree, corpus):
    args = tiny_overrides(corpus, tmp_path / "old", max_steps=8, save_steps=4, logging_steps=1, eval_steps=100,
                          warmup_steps=2)  # fmt: skip
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_ACCELERATE_CONFIG),
               "--num_processes", "2", "--main_process_port", str(free_port()), str(old_tree / "recipes/pretrain.py"),
               *args]  # fmt: skip
    old = subprocess.run(command, cwd=old_tree, env={**LAUNCH_ENV, "PYTHONPATH": str(old_tree)}, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert old.returncode == 0, old.stderr[-4000:]
    assert not (tmp_path / "old" / "checkpoint-4" / "run_identity.json").exists(), "written by the old code"

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "old", resumed_dir, ignore=shutil.ignore_patterns("checkpoint-8", "final"))
    (resumed_dir / "latest").write_text("checkpoint-4\n")
    resumed = launch(REPO / "recipes/pretrain.py", [*args, "--output_dir", str(resumed_dir)])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "checkpoint-4 at step 4" in resumed.stderr
    assert train_losses(resumed_dir) == train_losses(tmp_path / "old") and sorted(train_losses(resumed_dir)) == list(
        range(1, 9)
    )

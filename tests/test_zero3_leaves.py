"""ZeRO-3 leaf modules (`zero3_leaf_modules`): whole decoder layers gathered at once must train exactly as per-module
hooks do, and a checkpoint written with one granularity must continue bit-exact under the other."""

import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, eval_losses, launch, tiny_overrides, train_losses

pytestmark = pytest.mark.multiprocess

# 20 steps, every one logged, validation and a checkpoint at 10 and 20
SCHEDULE = dict(max_steps=20, save_steps=10, save_total_limit=2, logging_steps=1, eval_steps=10, max_eval_samples=16,
                warmup_steps=4)  # fmt: skip
PER_MODULE = "[]"
# The start line, its count taken from the hooks the engine registered (a leaf flag set too late hooks all 59)
LEAVES_SAID = "LlamaDecoderLayer gathered whole (zero3_leaf_modules): hooks on 11 modules instead of 59"


def run(corpus, output_dir: Path, leaves: str | None):
    extra = {} if leaves is None else {"zero3_leaf_modules": leaves}
    result = launch(REPO / "recipes/pretrain.py", tiny_overrides(corpus, output_dir, **SCHEDULE, **extra))
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def granularity(result) -> str:
    """What the run's start line says after "ZeRO-3 granularity: " (the plan printed before it has a line of its own
    that starts so)."""
    start = "pretrain: ZeRO-3 granularity: "
    said = {line.split(start, 1)[1] for line in result.stderr.splitlines() if start in line}
    assert len(said) == 1, said
    return said.pop()


@pytest.fixture(scope="module")
def per_module(tmp_path_factory, corpus):
    output_dir = tmp_path_factory.mktemp("leaves") / "per_module"
    result = run(corpus, output_dir, PER_MODULE)
    assert granularity(result) == "every module (zero3_leaf_modules []): hooks on 59 modules"
    return output_dir


def test_leaf_layers_train_exactly_as_per_module_hooks(tmp_path, corpus, per_module):
    """The recipe's default (each LlamaDecoderLayer a leaf, gradient checkpointing on in chunks of 2 layers) against
    every module hooked: the same losses, bit for bit, at every step and evaluation. Equal losses hold whether or not
    the leaves took effect, so the engine's own hook count (the start line) says that they did: 11 against 59."""
    result = run(corpus, tmp_path / "leaves", None)
    assert granularity(result) == LEAVES_SAID, "the line docs/training.md quotes: the leaves are in effect"
    expected = train_losses(per_module)
    assert sorted(expected) == list(range(1, 21))
    assert train_losses(tmp_path / "leaves") == expected
    assert eval_losses(tmp_path / "leaves") == eval_losses(per_module)


def test_a_per_module_checkpoint_resumes_bit_exact_with_leaves(tmp_path, corpus, per_module):
    output_dir = tmp_path / "resumed"
    shutil.copytree(per_module, output_dir)
    shutil.rmtree(output_dir / "checkpoint-20")
    result = run(corpus, output_dir, None)
    assert "checkpoint-10 at step 10" in result.stderr
    assert granularity(result) == LEAVES_SAID
    assert train_losses(output_dir) == train_losses(per_module)
    assert eval_losses(output_dir) == eval_losses(per_module)

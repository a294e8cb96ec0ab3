"""Training on a preprocessed directory under real 2-process ZeRO-3, with 2 dataloader workers per rank
and document masking: a relaunch in a fresh process continues with exactly the batches an uninterrupted
run draws, and a checkpoint whose data position is reset does not."""

import json
import shutil

import pytest
import torch

from data_prep.preprocess import preprocess
from tests.conftest import REPO, data_position, forge_data_position, launch, tiny_overrides, train_losses

pytestmark = pytest.mark.multiprocess

STEPS = 12


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("packed") / "train"
    preprocess(str(corpus["tokenizer"]), [str(corpus["train"])], str(out), 128, 2, rows_per_shard=500)
    return out


def run_args(corpus, packed_dir, output_dir, **extra):
    return tiny_overrides(
        corpus,
        output_dir,
        train_files=packed_dir,
        max_steps=STEPS,
        save_steps=6,
        logging_steps=1,
        eval_steps=6,
        max_eval_samples=16,
        warmup_steps=3,
        dataloader_num_workers=2,
        document_masking="true",
        **extra,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus, packed_dir):
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    result = launch(REPO / "recipes/pretrain.py", run_args(corpus, packed_dir, output_dir))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "preprocessed rows" in result.stderr
    assert sorted(train_losses(output_dir)) == list(range(1, STEPS + 1))
    return output_dir


def resume_from_step_6(tmp_path, uninterrupted, corpus, packed_dir, reset_position: bool):
    output_dir = tmp_path / "resumed"
    shutil.copytree(uninterrupted, output_dir)
    shutil.rmtree(output_dir / f"checkpoint-{STEPS}")
    shutil.rmtree(output_dir / "final")
    position = data_position(output_dir / "checkpoint-6")
    assert position["kind"] == "preprocessed"
    assert position["global_rows_consumed"] == 6 * 32  # steps x global batch
    if reset_position:
        forge_data_position(output_dir / "checkpoint-6", lambda position: position.update(global_rows_consumed=0))
    result = launch(REPO / "recipes/pretrain.py", run_args(corpus, packed_dir, output_dir))
    assert result.returncode == 0, result.stderr[-4000:]
    assert "checkpoint-6 at step 6" in result.stderr
    return train_losses(output_dir)


def test_relaunch_draws_exactly_the_uninterrupted_batches(tmp_path, uninterrupted, corpus, packed_dir):
    assert resume_from_step_6(tmp_path, uninterrupted, corpus, packed_dir, reset_position=False) == train_losses(
        uninterrupted
    )


def test_negative_control_with_the_position_reset_diverges(tmp_path, uninterrupted, corpus, packed_dir):
    expected = train_losses(uninterrupted)
    train = resume_from_step_6(tmp_path, uninterrupted, corpus, packed_dir, reset_position=True)
    assert all(train[s] == expected[s] for s in range(1, 7))
    assert all(train[s] != expected[s] for s in range(7, STEPS + 1))


def test_resume_on_another_number_of_processes_through_the_universal_checkpoint(
    tmp_path, uninterrupted, corpus, packed_dir
):
    """2 processes -> 1 with the same global batch (accumulation 2 -> 4): refused until the checkpoint is
    converted, then the same rows are trained on; losses match the 2-process run up to summation order."""
    import subprocess
    import sys

    output_dir = tmp_path / "one"
    shutil.copytree(uninterrupted, output_dir)
    shutil.rmtree(output_dir / f"checkpoint-{STEPS}")
    shutil.rmtree(output_dir / "final")
    args = run_args(corpus, packed_dir, output_dir, gradient_accumulation_steps=4)
    refused = launch(REPO / "recipes/pretrain.py", args, num_processes=1)
    assert refused.returncode != 0
    command = f"ds_to_universal --input_folder {output_dir}/checkpoint-6/pytorch_model"
    assert command in refused.stderr and "parameters; this rank holds" not in refused.stderr

    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         str(output_dir / "checkpoint-6" / "pytorch_model"), "--output_folder",
         str(output_dir / "checkpoint-6" / "universal" / "pytorch_model")],
        check=True, capture_output=True, cwd=REPO,
    )  # fmt: skip
    resumed = launch(REPO / "recipes/pretrain.py", args, num_processes=1)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "loading its universal checkpoint on 1" in resumed.stderr
    expected, train = train_losses(uninterrupted), train_losses(output_dir)
    assert train[7] == pytest.approx(expected[7], rel=1e-6), "same model and same rows at the first step"
    assert all(train[s] == pytest.approx(expected[s], rel=1e-4) for s in range(8, STEPS + 1))
    manifest = json.loads((output_dir / f"checkpoint-{STEPS}" / "manifest.json").read_text())
    assert manifest["world_size"] == 1
    assert data_position(output_dir / f"checkpoint-{STEPS}")["global_rows_consumed"] == STEPS * 32


def test_raw_text_positions_cannot_move_to_another_world_size(tmp_path, corpus, reference_run):
    """The session's raw-text run (2 processes) resumed on 1: refused, naming the way out (checked where a launch
    checks it, before the model; no launch needed to see the answer)."""
    from transformers import AutoTokenizer

    from recipes.config import load_config
    from recipes.training.checkpointing import read_trainer_state
    from recipes.training.train_data import TrainData, open_train_source
    from tests.conftest import TINY_RECIPE

    args = tiny_overrides(corpus, tmp_path / "raw", max_steps=20, gradient_accumulation_steps=4)
    config = load_config(TINY_RECIPE, args[2:])
    tokenizer = AutoTokenizer.from_pretrained(corpus["tokenizer"])
    data = TrainData(open_train_source(config, tokenizer, 1), config, tokenizer, rank=0, world=1)
    problem = data.resume_problem(read_trainer_state(reference_run / "checkpoint-16")["data_position"])
    assert "raw-text data position is per rank" in problem and "data_prep.preprocess" in problem


def test_export_reads_the_universal_form_when_the_rank_shards_are_gone(tmp_path, uninterrupted, corpus):
    """A checkpoint kept only in its universal form (after a world-size change) still exports, to the same weights."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from recipes.export import export_checkpoint

    checkpoint = tmp_path / "checkpoint-6"
    shutil.copytree(uninterrupted / "checkpoint-6", checkpoint)
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         str(checkpoint / "pytorch_model"), "--output_folder", str(checkpoint / "universal" / "pytorch_model")],
        check=True, capture_output=True, cwd=REPO,
    )  # fmt: skip
    from_shards = export_checkpoint(checkpoint, tmp_path / "from_shards", dtype="float32")
    for shard in (checkpoint / "pytorch_model").glob("*optim_states.pt"):
        shard.unlink()
    from_universal = export_checkpoint(checkpoint, tmp_path / "from_universal", dtype="float32")
    ours, theirs = load_file(from_shards / "model.safetensors"), load_file(from_universal / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

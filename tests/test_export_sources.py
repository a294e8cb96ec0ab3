"""What `python -m recipes.export` reads of a checkpoint and what it writes from it: the form of the weights it reads
(the rank shards, or `universal/` when they are not all there), every file it reads checked first (one line, exit
code 2, nothing written), the model's shape as the run trained with it, a tied output head, and names that a run's
rotation or start cannot take for its own."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from common.files import sha256_of
from common.lock import FileLock
from recipes.export import export_checkpoint
from tests.conftest import LAUNCH_ENV, REPO

multiprocess = pytest.mark.multiprocess  # the tests that read the session's trained run


class OneProcess:
    """The part of an Accelerator that rotation and elastic.ensure_universal use, for one process."""

    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass


def export(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes.export", *map(str, args)], cwd=REPO, env=LAUNCH_ENV,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def refused(result: subprocess.CompletedProcess, *said: str) -> None:
    """Exit code 2 and one line that says each of `said`."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr[-3000:]
    assert all(part in result.stderr for part in said), result.stderr


def forge(checkpoint: Path, name: str, text: str) -> None:
    """Rewrite a checkpoint's file and its manifest entry with it: the checkpoint stays self-consistent."""
    (checkpoint / name).write_text(text)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": (checkpoint / name).stat().st_size, "sha256": sha256_of(checkpoint / name)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=2))


def flip_bytes(path: Path, at: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    data[at : at + 8] = bytes(255 - b for b in data[at : at + 8])
    path.write_bytes(bytes(data))


@pytest.fixture
def run(tmp_path, trained_run) -> tuple[Path, Path]:
    """A copy of the session's run and its newest checkpoint."""
    copy = tmp_path / "run"
    shutil.copytree(trained_run["dir"], copy, ignore=shutil.ignore_patterns("final", "tensorboard"))
    return copy, copy / "checkpoint-40"


@pytest.fixture(scope="module")
def converted(tmp_path_factory, trained_run) -> Path:
    """The session run's newest checkpoint with its universal/ (the recipe's own conversion, with its listing)."""
    from recipes.training import elastic
    from recipes.training.universal import verify_universal_share

    copy = tmp_path_factory.mktemp("converted") / "run"
    shutil.copytree(trained_run["dir"], copy, ignore=shutil.ignore_patterns("final", "tensorboard"))
    elastic.ensure_universal(copy / "checkpoint-40", OneProcess(), lambda path: verify_universal_share(path, 0, 1))
    return copy


@pytest.fixture
def universal_run(tmp_path, converted) -> tuple[Path, Path]:
    copy = tmp_path / "run"
    shutil.copytree(converted, copy)
    return copy, copy / "checkpoint-40"


@multiprocess
@pytest.mark.parametrize("damage", ["flipped", "unlisted", "no listing"])
def test_universal_files_are_checked_against_the_conversions_listing(universal_run, tmp_path, damage):
    """A checkpoint kept in its universal form only (rank shards deleted after a world-size change) exported a
    universal fp32.pt with a bit flipped, exit 0: its files are hashed against universal/conversion.json first, a
    weights file the listing does not name is refused, and a universal/ without a listing (converted by hand) is
    exported with a warning that says its files were not checked."""
    _, checkpoint = universal_run
    for shard in (checkpoint / "pytorch_model").glob("*optim_states.pt"):
        shard.unlink()
    root = checkpoint / "universal"
    weights = root / "pytorch_model" / "zero" / "model.layers.1.mlp.up_proj.weight" / "fp32.pt"
    listing = json.loads((root / "conversion.json").read_text())
    if damage == "no listing":
        (root / "conversion.json").unlink()
        result = export(checkpoint, "--output", tmp_path / "model")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"{root} has no conversion.json (converted by hand?): its files cannot be checked" in result.stderr
        return
    if damage == "unlisted":
        del listing["files"][str(weights.relative_to(root))]
        (root / "conversion.json").write_text(json.dumps(listing))
    flip_bytes(weights)  # same size: only a hash sees it
    said = "is not in" if damage == "unlisted" else "sha256 differs from the conversion's conversion.json"
    refused(export(checkpoint, "--output", tmp_path / "model"), f"cannot export {checkpoint}: {weights}", said)
    assert not (tmp_path / "model").exists()


@multiprocess
def test_a_checkpoint_with_some_rank_shards_gone_exports_from_its_universal_form(universal_run, tmp_path):
    """universal/ and part of the rank shards (one node's copy deleted) ended in DeepSpeed's ValueError traceback,
    exit 1 (requeued): the export reads universal/ when the rank shards are not all there, to the same weights."""
    _, checkpoint = universal_run
    from_shards = export_checkpoint(checkpoint, tmp_path / "from_shards", dtype="float32")
    next((checkpoint / "pytorch_model").glob("*rank_1_*optim_states.pt")).unlink()
    result = export(checkpoint, "--output", tmp_path / "from_universal", "--dtype", "float32")
    assert result.returncode == 0, result.stderr[-3000:]
    from_universal = tmp_path / "from_universal"
    assert json.loads((from_universal / "export.json").read_text())["weights_from"] == "universal/"
    ours, theirs = load_file(from_shards / "model.safetensors"), load_file(from_universal / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@multiprocess
def test_a_rank_file_the_manifest_does_not_list_is_refused(run, tmp_path):
    """DeepSpeed's consolidation reads every `*_optim_states.pt` in pytorch_model/; one the save did not write was
    read without a hash to check it against."""
    _, checkpoint = run
    shard = next((checkpoint / "pytorch_model").glob("*rank_1_*optim_states.pt"))
    stray = shard.with_name(shard.name.replace("rank_1_", "rank_2_"))
    shutil.copy(shard, stray)
    refused(export(checkpoint, "--output", tmp_path / "model"), f"{stray} is not in manifest.json")
    assert not (tmp_path / "model").exists()


@multiprocess
def test_a_model_name_or_path_config_edited_after_training_is_refused(run, trained_run, tmp_path):
    """With model_name_or_path the exported config.json is built again from that directory's config.json: edited
    after training (rope_theta, rms_norm_eps, max_position_embeddings), the new values were exported, exit 0. The
    config the export builds is compared with the shape the run trained with (run_identity.json)."""
    _, checkpoint = run
    base = tmp_path / "base"  # the model a continued run started from: the session run's final/, same shape
    shutil.copytree(trained_run["dir"] / "final", base)
    recipe = yaml.safe_load((checkpoint / "config.yaml").read_text())
    recipe.update(model_name_or_path=str(base), model_config={})
    forge(checkpoint, "config.yaml", yaml.safe_dump(recipe))
    exported = export_checkpoint(checkpoint, tmp_path / "unchanged")
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == 1024
    edited = json.loads((base / "config.json").read_text())
    trained = dict(edited)
    edited.update(rms_norm_eps=trained["rms_norm_eps"] * 10, max_position_embeddings=131072,
                  rope_parameters={"rope_theta": 123456.0, "rope_type": "default"})  # fmt: skip
    (base / "config.json").write_text(json.dumps(edited))
    refused(export(checkpoint, "--output", tmp_path / "model"), f"model_name_or_path {base} is not the one the run "
            f"trained with", f"max_position_embeddings {trained['max_position_embeddings']} -> 131072",
            f"rms_norm_eps {trained['rms_norm_eps']!r} -> {edited['rms_norm_eps']!r}",
            f"rope_parameters {trained['rope_parameters']!r} -> {edited['rope_parameters']!r}")  # fmt: skip
    assert not (tmp_path / "model").exists()


@multiprocess
def test_a_tied_output_head_is_exported_once_as_the_embedding(run, tmp_path, monkeypatch):
    """`tie_word_embeddings: true` trained, then the export crashed (safetensors refuses tensors that share memory:
    DeepSpeed's consolidation gives the tied head as the embedding's own tensor), exit 1, requeued: a crash loop. The
    head is written once, as the embedding, as save_pretrained does; from_pretrained ties it again."""
    from deepspeed.utils import zero_to_fp32
    from transformers import AutoModelForCausalLM

    _, checkpoint = run
    recipe = yaml.safe_load((checkpoint / "config.yaml").read_text())
    recipe["model_config"]["tie_word_embeddings"] = True
    forge(checkpoint, "config.yaml", yaml.safe_dump(recipe))
    identity = json.loads((checkpoint / "run_identity.json").read_text())
    identity["model_shape"]["tie_word_embeddings"] = True
    forge(checkpoint, "run_identity.json", json.dumps(identity, indent=2))
    consolidate = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint

    def tied(*args, **kwargs):  # what DeepSpeed gives for a tied model (its `shared_params`): one tensor, two names
        state = consolidate(*args, **kwargs)
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    monkeypatch.setattr(zero_to_fp32, "get_fp32_state_dict_from_zero_checkpoint", tied)
    exported = export_checkpoint(checkpoint, tmp_path / "model", dtype="float32")
    assert json.loads((exported / "config.json").read_text())["tie_word_embeddings"] is True
    written = load_file(exported / "model.safetensors")
    assert "lm_head.weight" not in written
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    embedding = consolidate(str(checkpoint), tag="pytorch_model")["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight, embedding)


@multiprocess
def test_a_checkpoint_on_storage_this_user_cannot_write_exports_without_its_reader_pin(run, tmp_path, monkeypatch,
                                                                                      caplog):  # fmt: skip
    """A checkpoint on a read-only mount (or a teammate's run) failed the export creating `.checkpoint-N.readers`:
    there is no pin to take there, so the export warns and reads on."""
    _, checkpoint = run
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).endswith(".readers"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with caplog.at_level("WARNING", logger="pretrain"):
        exported = export_checkpoint(checkpoint, tmp_path / "model")
    assert (exported / "model.safetensors").is_file()
    assert f"cannot pin {checkpoint} against rotation" in caplog.text and "Read-only file system" in caplog.text


@multiprocess
def test_final_names_the_class_to_load_and_the_tokenizers_pad_id(trained_run):
    """vLLM and TGI read `architectures` from config.json, which the export left out; the pad id stays the
    tokenizer's in the exported config (the training model has none: see below)."""
    from transformers import AutoTokenizer

    config = json.loads((trained_run["dir"] / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(trained_run["corpus"]["tokenizer"])
    assert config["pad_token_id"] == tokenizer.pad_token_id is not None


def test_continued_pretraining_from_an_export_does_not_freeze_its_pad_row(tmp_path):
    """An export's config.json carries the tokenizer's pad id; training from it (model_name_or_path) kept it, and
    nn.Embedding(padding_idx=pad) never updates that row (EOS's, for a tokenizer whose pad is its EOS). The training
    model's config has none; the export's config.json gets the tokenizer's again."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from recipes.training.model import llama_config, with_token_ids

    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                bos_token_id=0, eos_token_id=0, pad_token_id=0).save_pretrained(tmp_path)  # fmt: skip
    recipe = types.SimpleNamespace(model_name_or_path=str(tmp_path), model_config={})
    model_config = llama_config(recipe, 64)
    assert model_config.pad_token_id is None
    with torch.device("meta"):
        assert AutoModelForCausalLM.from_config(model_config).model.embed_tokens.padding_idx is None
    tokenizer = types.SimpleNamespace(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    assert with_token_ids(llama_config(recipe, 64), tokenizer).pad_token_id == 0


def test_an_export_beside_the_checkpoints_is_not_taken_for_a_save(tmp_path):
    """An export to RUN/checkpoint-20-hf staged in `.checkpoint-20-hf.tmp`, which a live run's rotation and its next
    start remove as a killed save's. Its staging is named apart now; a killed one still goes at the next start, as
    does one an earlier version named `.NAME.tmp`, and an output it was replacing is put back, not taken for a
    checkpoint set aside by a killed replacement (which needs a manifest to be put back)."""
    from recipes.training.checkpointing import export_staging, rotate_checkpoints
    from recipes.training.output_dir import remove_stale_checkpoint_staging, remove_stale_export_staging

    staging, lock = export_staging(tmp_path / "checkpoint-20-hf")
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"weights")
    killed_save = tmp_path / ".checkpoint-30.tmp"
    killed_save.mkdir()
    with FileLock(lock, what="a live export"):
        rotate_checkpoints(OneProcess(), tmp_path, 2, None)
        assert staging.is_dir() and not killed_save.exists()
        assert remove_stale_checkpoint_staging(tmp_path) == [] and staging.is_dir()
    lock.touch()  # what a SIGKILLed export leaves: its staging and its lock file, held by no one
    earlier = tmp_path / ".model.tmp"  # an earlier version's staging of an export to `model`
    earlier.mkdir()
    (tmp_path / ".model.export-lock").touch()
    replaced = tmp_path / ".checkpoint-10-hf.replaced"  # `--overwrite` killed between its two renames
    replaced.mkdir()
    (replaced / "model.safetensors").write_bytes(b"the old export")
    (tmp_path / ".checkpoint-10-hf.export-lock").touch()
    assert remove_stale_checkpoint_staging(tmp_path) == [] and replaced.is_dir()
    removed = sorted(path.name for path, _ in remove_stale_export_staging(tmp_path))
    assert removed == sorted([earlier.name, staging.name])
    assert (tmp_path / "checkpoint-10-hf" / "model.safetensors").read_bytes() == b"the old export"


def test_a_stop_during_the_final_export_advises_only_what_works():
    """The advice was `python -m recipes.export SRC --output RUN/final --overwrite`, which the export refuses (the
    output lies inside the run directory): a relaunch of the run is what exports final/."""
    from recipes.export import ExportInterrupted, _abandoned_on_stop_signal

    signals = types.SimpleNamespace(received=signal.SIGTERM)
    with pytest.raises(ExportInterrupted) as raised, \
            _abandoned_on_stop_signal(signals, Path("run/checkpoint-40"), Path("run/final")):  # fmt: skip
        raise AssertionError("the export must not start")
    said = str(raised.value)
    assert "checkpoint-40 is saved and complete; final/ was not written: relaunch the same command" in said
    assert "recipes.export" not in said and "--overwrite" not in said

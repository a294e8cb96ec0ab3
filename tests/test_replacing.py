"""A tree that replaces another of the same name (a checkpoint saved again after a rollback or an older resume, final/
exported again, the run's tokenizer copy) is never left half deleted by a kill."""

import os
import shutil

import pytest

from recipes.training.checkpointing import manifest_problems
from tests.test_checkpointing import OneRankSaving, make_checkpoint


class Killed(BaseException):
    pass


def killed_half_way_through_a_deletion(real_rmtree):
    """`shutil.rmtree` that removes one file of what it is given, then dies (SIGKILL in the middle of minutes of
    unlinking ~830 GB)."""

    def rmtree(path, ignore_errors=False, **kwargs):
        if not os.path.exists(path):
            return real_rmtree(path, ignore_errors=ignore_errors, **kwargs)
        files = sorted(p for p in os.scandir(path) if p.is_file()) if os.path.isdir(path) else []
        for entry in os.scandir(path) if os.path.isdir(path) else []:
            if entry.is_dir():
                files += [f for f in os.scandir(entry.path) if f.is_file()]
        if files:
            os.unlink(files[0].path)
        raise Killed(path)

    return rmtree


def test_a_save_over_an_older_save_of_the_same_step_killed_while_deleting_it_leaves_a_complete_checkpoint(
    tmp_path, monkeypatch
):
    """A step saved again (after a rollback, or a resume of an older checkpoint) removed the old checkpoint-N before
    renaming the new one in: a kill during that removal (minutes at 70B) left a checkpoint-N with files missing, and
    `latest` pointing at it. The old one is renamed aside first now, removed after the new one took its name."""
    from recipes.training.checkpointing import save_checkpoint
    from recipes.training.output_dir import remove_stale_checkpoint_staging

    make_checkpoint(tmp_path, 100)
    make_checkpoint(tmp_path, 200, payload=b"weights before the rollback")
    (tmp_path / "latest").write_text("checkpoint-200\n")
    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", killed_half_way_through_a_deletion(shutil.rmtree))
        with pytest.raises(Killed):
            save_checkpoint(OneRankSaving(), tmp_path, 200, {"global_step": 200}, {})
    assert manifest_problems(tmp_path / "checkpoint-200") == []
    assert (tmp_path / "checkpoint-200" / "trainer_state.json").is_file()  # the new one
    removed = [path.name for path, _ in remove_stale_checkpoint_staging(tmp_path)]
    assert removed == [".checkpoint-200.replaced"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-100", "checkpoint-200", "latest"]


def test_a_replacement_killed_between_its_two_renames_gets_the_old_tree_back_at_the_next_start(tmp_path, monkeypatch):
    from common.files import replace_directory
    from recipes.training.output_dir import remove_stale_checkpoint_staging

    old = make_checkpoint(tmp_path, 200, payload=b"old")
    staging = make_checkpoint(tmp_path, 999, payload=b"new").rename(tmp_path / ".checkpoint-200.tmp")
    real_replace = os.replace

    def replace(source, target):
        if str(source) == str(staging):
            raise Killed(source)
        real_replace(source, target)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", replace)
        with pytest.raises(Killed):
            replace_directory(staging, old)
    assert not old.exists()  # between the renames
    remove_stale_checkpoint_staging(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-200"]
    assert manifest_problems(old) == []
    assert (old / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_model_states.pt").read_bytes() == b"old"


def test_an_export_over_final_killed_while_deleting_the_old_one_leaves_the_new_one_and_nothing_hidden(
    tmp_path, monkeypatch
):
    """final/ exported again (the end of a resumed run, or `recipes.export` to the same --output) deleted the old
    model before renaming the new one in: a kill then left a final/ with shards missing, which an evaluation loads."""
    from common.files import replace_directory
    from recipes.training.checkpointing import export_staging
    from recipes.training.output_dir import remove_stale_export_staging

    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"old weights")
    staging, lock = export_staging(final)
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"new weights")
    lock.touch()
    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", killed_half_way_through_a_deletion(shutil.rmtree))
        with pytest.raises(Killed):
            replace_directory(staging, final)
    assert (final / "model.safetensors").read_bytes() == b"new weights"
    assert [path.name for path, _ in remove_stale_export_staging(tmp_path)] == [".final.replaced"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_the_runs_tokenizer_copy_set_aside_by_a_killed_replacement_goes_back_when_nothing_took_its_place(tmp_path):
    from recipes.training.output_dir import remove_stale_checkpoint_staging

    aside = tmp_path / ".tokenizer.replaced"
    aside.mkdir()
    (aside / "tokenizer.json").write_text("{}")
    assert remove_stale_checkpoint_staging(tmp_path) == []
    assert (tmp_path / "tokenizer" / "tokenizer.json").read_text() == "{}"


def test_a_stop_signal_right_after_a_loss_spike_rollback_saves_the_data_position_past_the_spike(tmp_path):
    """A rollback loads checkpoint-N but keeps the data position past the spike (and counts the rollback): a stop
    signal at that step found checkpoint-N "already saved" and saved nothing, so the resumed run trained on the
    skipped window again, met the same spike and rolled back again. That save writes checkpoint-N again now."""
    import types

    from recipes.training.checkpointing import Checkpointer, read_trainer_state

    class Position:
        rows = 0

        def state_dict(self):
            return {"rows_consumed": self.rows}

        def load_state_dict(self, state):
            self.rows = state["rows_consumed"]

    class Saving(OneRankSaving):
        def load_state(self, directory):
            pass

    position = Position()
    engine = types.SimpleNamespace(_config=types.SimpleNamespace())
    checkpointer = Checkpointer(Saving(), engine, tmp_path, None, {}, {"data_position": position})
    position.rows = 64
    first = checkpointer.save(4)
    assert checkpointer.is_current(4) and checkpointer.save(4) == first  # nothing new to write
    position.rows = 96  # the spike's window, read after the checkpoint
    checkpointer.load(first, skip=("data_position",))  # the rollback
    assert not checkpointer.is_current(4)
    assert checkpointer.save(4) == first  # the stop signal's save, at the same step
    assert read_trainer_state(first)["data_position"] == {"rows_consumed": 96}
    assert manifest_problems(first) == [] and checkpointer.is_current(4)
    checkpointer.load(first)  # a resume's load holds the whole state
    assert checkpointer.is_current(4)


def test_a_checkpoint_set_aside_whose_deletion_failed_part_way_is_removed_not_put_back(tmp_path):
    """The aside is deleted with errors ignored (an NFS .nfs* file, a permission): one left half deleted was renamed
    back to checkpoint-N at the next start, a checkpoint with no manifest that nothing would ever remove."""
    from recipes.training.output_dir import remove_stale_checkpoint_staging

    aside = make_checkpoint(tmp_path, 200).rename(tmp_path / ".checkpoint-200.replaced")
    (aside / "manifest.json").unlink()
    assert [path.name for path, _ in remove_stale_checkpoint_staging(tmp_path)] == [".checkpoint-200.replaced"]
    assert list(tmp_path.iterdir()) == []

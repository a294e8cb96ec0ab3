"""Checkpoint selection, validation and rotation on directories made here (no training needed)."""

import json
import shutil
from pathlib import Path

import pytest

from common.files import sha256_of
from recipes.training.checkpointing import (
    CheckpointError,
    checkpoints_to_delete,
    find_resume_checkpoint,
    manifest_problems,
    owned_files,
    verify_checksums,
    verify_share,
)


def make_checkpoint(root, step, complete=True, payload=b"weights"):
    directory = root / f"checkpoint-{step}"
    (directory / "pytorch_model").mkdir(parents=True)
    shard = directory / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shard.write_bytes(payload)
    if complete:
        files = {"pytorch_model/" + shard.name: {"bytes": len(payload), "sha256": sha256_of(shard)}}
        manifest = {"step": step, "world_size": 1, "data_position": None, "files": files}
        (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def test_auto_picks_the_newest_complete_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 100)
    make_checkpoint(tmp_path, 200)
    make_checkpoint(tmp_path, 300, complete=False)  # killed before its manifest was written
    (tmp_path / ".checkpoint-400.tmp").mkdir()
    path, notes = find_resume_checkpoint(tmp_path, "auto")
    assert path.name == "checkpoint-200"
    assert notes and "checkpoint-300" in notes[0] and "no manifest.json" in notes[0]
    assert find_resume_checkpoint(tmp_path, "none") == (None, [])
    assert find_resume_checkpoint(tmp_path / "empty", "auto") == (None, [])


def test_a_truncated_shard_is_caught(tmp_path):
    directory = make_checkpoint(tmp_path, 100)
    shard = next((directory / "pytorch_model").iterdir())
    shard.write_bytes(b"weig")
    assert "manifest says 7" in manifest_problems(directory)[0]
    with pytest.raises(CheckpointError, match="cannot resume from the requested checkpoint"):
        find_resume_checkpoint(tmp_path, str(directory))
    # the only checkpoint of a used output_dir: a fresh start there (as auto once did, saying so at INFO) would train
    # from step 0 over the run's history; refused, naming each checkpoint and what is wrong with it
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be resumed: skipped checkpoint-100: .*bytes"):
        find_resume_checkpoint(tmp_path, "auto")


def test_checksums_detect_corruption_of_the_same_size(tmp_path):
    directory = make_checkpoint(tmp_path, 100)
    assert verify_checksums(directory) == []
    next((directory / "pytorch_model").iterdir()).write_bytes(b"WEIGHTS")
    assert manifest_problems(directory) == [] and len(verify_checksums(directory)) == 1


def test_resume_skips_a_corrupted_checkpoint_for_the_previous_one_and_refuses_it_by_name(tmp_path):
    make_checkpoint(tmp_path, 100)
    newest = make_checkpoint(tmp_path, 200)
    shard = next((newest / "pytorch_model").iterdir())
    shard.write_bytes(b"WEIGHTz")  # same size: only the checksum can tell
    path, notes = find_resume_checkpoint(tmp_path, "auto")
    assert path.name == "checkpoint-100"
    assert "skipped checkpoint-200" in notes[0] and shard.name in notes[0] and "sha256" in notes[0]
    with pytest.raises(CheckpointError, match=shard.name):
        find_resume_checkpoint(tmp_path, str(newest))


def test_each_rank_verifies_a_share_and_the_shares_cover_every_file_once(tmp_path):
    directory = make_checkpoint(tmp_path, 100)
    for index, size in enumerate([5, 50, 500, 7]):
        extra = directory / f"extra_{index}.bin"
        extra.write_bytes(b"x" * size)
    manifest = json.loads((directory / "manifest.json").read_text())
    for extra in directory.glob("extra_*.bin"):
        manifest["files"][extra.name] = {"bytes": extra.stat().st_size, "sha256": sha256_of(extra)}
        extra.write_bytes(b"y" * extra.stat().st_size)  # every extra file is now damaged
    (directory / "manifest.json").write_text(json.dumps(manifest))
    shares = [verify_share(directory, rank, 3) for rank in range(3)]
    found = sorted(problem.split(":")[0].rsplit("/", 1)[-1] for share in shares for problem in share)
    assert found == ["extra_0.bin", "extra_1.bin", "extra_2.bin", "extra_3.bin"]
    assert all(shares), "the work is spread: every rank hashes something"


@pytest.mark.parametrize("manifest", ["{}", "[]", '{"step": 1, "world_size": 1, "files": {}}', '"text"'])
def test_a_manifest_of_the_wrong_shape_is_not_a_complete_checkpoint(tmp_path, manifest):
    directory = make_checkpoint(tmp_path, 100)
    (directory / "manifest.json").write_text(manifest)
    assert "is not a checkpoint manifest" in manifest_problems(directory)[0]
    with pytest.raises(CheckpointError, match="is not a checkpoint manifest"):
        find_resume_checkpoint(tmp_path, "auto")


def test_rotation_keeps_two_and_protects_the_best(tmp_path):
    checkpoints = [tmp_path / f"checkpoint-{s}" for s in (100, 200, 300, 400, 500)]
    assert checkpoints_to_delete(checkpoints, None) == []
    assert checkpoints_to_delete(checkpoints, 3) == checkpoints[:2]
    assert checkpoints_to_delete(checkpoints, 1) == checkpoints[:3], "never fewer than two kept"
    assert checkpoints_to_delete(checkpoints, 2, protected=checkpoints[0]) == checkpoints[1:3], "best kept on top"
    assert checkpoints_to_delete(checkpoints, 2, protected=checkpoints[4]) == checkpoints[:3]


def test_every_file_is_hashed_by_exactly_one_rank(tmp_path):
    for name in [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "trainer_state.json",
    ]:
        (tmp_path / name).write_text("x")
    rank0, rank1 = owned_files(tmp_path, 0, 2), owned_files(tmp_path, 1, 2)
    assert {p.name for p in rank1} == {
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "random_states_1.pkl",
    }
    assert len(rank0) + len(rank1) == 6 and not set(rank0) & set(rank1)


def test_rotation_keeps_a_checkpoint_an_export_is_reading_and_deletes_it_after(tmp_path):
    from types import SimpleNamespace

    from common.lock import FileLock
    from recipes.training.checkpointing import reader_pin, rotate_checkpoints

    accelerator = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)
    for step in (100, 200, 300):
        make_checkpoint(tmp_path, step)
    with FileLock(reader_pin(tmp_path / "checkpoint-100"), shared=True):
        assert rotate_checkpoints(accelerator, tmp_path, 2, None) == []
        assert (tmp_path / "checkpoint-100" / "manifest.json").exists(), "kept while it is read"
    assert rotate_checkpoints(accelerator, tmp_path, 2, None) == [tmp_path / "checkpoint-100"]
    assert not (tmp_path / "checkpoint-100").exists() and not reader_pin(tmp_path / "checkpoint-100").exists()


def test_the_best_loss_belongs_to_the_validation_set_it_was_measured_on():
    from recipes.training.run_state import RunState

    old = RunState(step=8, best_eval_loss=6.46, evaluations_without_improvement=1, best_checkpoint="checkpoint-4")
    assert old.key_best_to("a" * 64) is None, "saved before the set was recorded: nothing to compare, kept"
    assert (old.best_eval_loss, old.evaluations_without_improvement, old.validation_sha256) == (6.46, 1, "a" * 64)
    assert old.key_best_to("a" * 64) is None and old.best_checkpoint == "checkpoint-4"
    said = old.key_best_to("b" * 64)
    assert said.startswith("validation set changed since the last evaluation (sha256 aaaaaaaaaaaa -> bbbbbbbbbbbb)")
    assert "the old set's best was 6.4600 at checkpoint-4" in said
    assert (old.best_eval_loss, old.evaluations_without_improvement, old.best_checkpoint) == (None, 0, None)
    restored = RunState()
    restored.load_state_dict(old.state_dict())
    assert restored == old and restored.key_best_to("b" * 64) is None


def test_a_raw_training_file_shuffled_under_its_name_is_another_run(tmp_path):
    """Raw files were known by name and size only: a file re-shuffled in place (as the docs advise before a run)
    resumed at a data position that now points at other documents."""
    import random

    from recipes.training.resume import data_identity, identity_changes

    source = tmp_path / "train.jsonl"
    lines = [json.dumps({"text": f"document {i} " + "word " * (i % 50)}) + "\n" for i in range(20_000)]
    source.write_text("".join(lines))
    saved = {"train_data": data_identity([str(source)])}
    assert identity_changes(saved, {"train_data": data_identity([str(source)])}) == []
    random.Random(0).shuffle(lines)
    source.write_text("".join(lines))
    assert source.stat().st_size == saved["train_data"][0]["bytes"], "same name, same size"
    changes = identity_changes(saved, {"train_data": data_identity([str(source)])})
    assert len(changes) == 1 and changes[0].startswith("train_data: ") and "sample_sha256" in changes[0]
    # a checkpoint of the version before sampled hashes: name and size are all it has, and they still match
    older = {"train_data": [{"name": "train.jsonl", "bytes": source.stat().st_size}]}
    assert identity_changes(older, {"train_data": data_identity([str(source)])}) == []
    assert identity_changes(older, {"train_data": [{"name": "train.jsonl", "bytes": 1, "sample_sha256": "x"}]})


def test_a_max_steps_below_the_reached_step_is_refused_naming_both(tmp_path):
    from recipes.training.resume import steps_problem

    checkpoint = tmp_path / "checkpoint-12"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"run_state": {"step": 12}}))
    assert steps_problem(16, checkpoint) is None and steps_problem(12, checkpoint) is None
    said = steps_problem(8, checkpoint)
    assert said.startswith("max_steps / total_tokens give 8 steps, but checkpoint-12 is at step 12")
    assert "Raise max_steps to continue it" in said


def test_finished_work_leaves_no_lock_file_and_a_held_one_still_excludes(tmp_path):
    """`.NAME.export-lock` and `.checkpoint-N.readers` stayed behind after every finished export (issue 37): the last
    holder now removes the file as it lets go, and a process that opened the file meanwhile makes a new one."""
    from common.lock import FileLock, LockedError, held_by_someone

    pin = tmp_path / ".checkpoint-10.readers"
    first, second = FileLock(pin, shared=True).acquire(), FileLock(pin, shared=True).acquire()
    first.release()
    assert pin.exists() and held_by_someone(pin), "another reader still holds it"
    second.release()
    assert not pin.exists()
    lock = tmp_path / ".final.export-lock"
    with FileLock(lock), pytest.raises(LockedError, match="is held by another export to this --output"):
        FileLock(lock, what="another export to this --output").acquire()
    assert not lock.exists()
    # a lock taken on a file its last holder removed meanwhile is no lock: the taker makes a new file
    import fcntl
    import os

    stale = os.open(lock, os.O_RDWR | os.O_CREAT)  # opened before the holder below lets go of (and removes) it
    with FileLock(lock):
        pass
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a lock on the removed file, which nobody else can see
    with FileLock(lock):
        assert lock.exists() and held_by_someone(lock)
    os.close(stale)


def test_an_export_to_a_dangling_link_is_refused_before_any_work(tmp_path):
    """It wrote the whole model into staging before refusing (issue 37)."""
    from recipes.config import ConfigError
    from recipes.export import check_output

    (tmp_path / "models").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match="is a symbolic link to .*gone, which does not exist"):
        check_output(tmp_path / "models", False, {"the checkpoint": tmp_path / "checkpoint-1"})
    check_output(tmp_path / "new", False, {"the checkpoint": tmp_path / "checkpoint-1"})  # a plain new path is fine


def test_an_explicit_resume_older_than_the_directorys_newest_is_refused_unless_this_job_saved_it(tmp_path, monkeypatch):
    """`--resume out/checkpoint-200` into a directory holding checkpoint-400 went back to step 200, and rotation
    (which keeps the highest steps) then deleted the new saves, so every later `--resume auto` went back to the
    abandoned checkpoint-400. Refused now, unless checkpoint-400 was saved by this very Slurm job: a requeue repeats
    the job's arguments, its --resume too, and then continues from the job's own newest."""
    from types import SimpleNamespace

    from recipes.training.resume import resume_request

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    out, elsewhere = tmp_path / "out", tmp_path / "other_run"
    own, started_from = make_checkpoint(out, 200), make_checkpoint(elsewhere, 100)
    config = SimpleNamespace(output_dir=str(out), resume_from_checkpoint=str(own))
    assert resume_request(config) == str(own), "nothing later: as asked"
    make_checkpoint(out, 300, complete=False)  # a killed save is no later checkpoint
    assert resume_request(config) == str(own)
    later = make_checkpoint(out, 400)
    with pytest.raises(CheckpointError) as refused:
        resume_request(config)
    said = str(refused.value)
    assert said.startswith(f"--resume {own}: {out} holds checkpoint-400, a later step") and "--resume auto" in said
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    for requested in (started_from, own):  # from another run's checkpoint, or going back inside the directory
        config.resume_from_checkpoint = str(requested)
        with pytest.raises(CheckpointError, match="holds checkpoint-400"):
            resume_request(config)  # checkpoint-400 is no save of job 77's (an abandoned run's, say)
        manifest = json.loads((later / "manifest.json").read_text())
        (later / "manifest.json").write_text(json.dumps({**manifest, "slurm_job_id": "77"}))
        assert resume_request(config) == "auto", "job 77's requeue continues from its own newest"
        (later / "manifest.json").write_text(json.dumps({**manifest, "slurm_job_id": "78"}))
    # the job's --resume checkpoint rotated away once the job had saved enough: its requeue refused to start ("does
    # not exist", exit 2, a job waiting for a person) instead of continuing from the job's own newest
    gone = out / "checkpoint-100"
    config.resume_from_checkpoint = str(gone)
    assert resume_request(config) == str(gone), "another job's checkpoint-400: the missing path is said where loaded"
    (later / "manifest.json").write_text(json.dumps({**manifest, "slurm_job_id": "77"}))
    assert resume_request(config) == "auto"
    for word in ("auto", "none"):
        config.resume_from_checkpoint = word
        assert resume_request(config) == word


def test_a_save_that_would_not_fit_is_found_before_any_rank_writes(tmp_path, monkeypatch):
    """A disk that filled on some ranks only (a shared file system fills while the shards are written) left those
    ranks in the failure's all-reduce and the others in DeepSpeed's barrier: a hang until the collective timeout, exit
    1, not the failed save's exit 4. Every rank now compares the free space with the newest checkpoint's size first."""
    import collections
    import shutil

    from recipes.training.checkpointing import LATEST, space_problem

    assert space_problem(tmp_path) is None, "no checkpoint yet: nothing to go by"
    make_checkpoint(tmp_path, 100, payload=b"x" * 1000)
    (tmp_path / LATEST).write_text("checkpoint-100\n")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**12, 0, 1000))
    assert space_problem(tmp_path) == f"0.0 GB free in {tmp_path}, and a checkpoint takes 0.0 GB (checkpoint-100)"
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**12, 0, 1100))
    assert space_problem(tmp_path) is None, "5 % of margin"
    (tmp_path / LATEST).write_text("checkpoint-300\n")  # a pointer to nothing complete: no figure to compare
    assert space_problem(tmp_path) is None

    def stale_handle(_):
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(shutil, "disk_usage", stale_handle)
    (tmp_path / LATEST).write_text("checkpoint-100\n")
    assert space_problem(tmp_path) is None, "an error on one rank must not leave it out of the all-reduce"


def test_every_rank_resumes_from_the_checkpoint_the_main_process_sees(tmp_path):
    """A node whose file system lags behind (NFS attribute caching after a requeue) did not list the checkpoint saved
    just before the crash: its ranks picked the previous one while the others loaded the newest, different steps in
    one run. Every rank now goes by the main process's listing and manifests."""
    main_view, lagging_view = tmp_path / "main", tmp_path / "lagging"
    for step in (100, 200):
        make_checkpoint(main_view, step)
    make_checkpoint(lagging_view, 100)
    seen_by_main = [find_resume_checkpoint(main_view, "auto")]
    views = iter([list(reversed(sorted(main_view.glob("checkpoint-*")))), []])  # the listing, then checkpoint-200's

    def from_main(value):
        return next(views)

    verified = []
    path, _ = find_resume_checkpoint(lagging_view, "auto", lambda p: verified.append(p) or [], from_main)
    assert path == seen_by_main[0][0] == main_view / "checkpoint-200" and verified == [path]
    assert find_resume_checkpoint(lagging_view, "auto")[0].name == "checkpoint-100", "what it picked on its own"


class OneRankSaving:
    """The part of an Accelerator a save uses, in one process; `save_state` writes files as DeepSpeed lays them out."""

    device, process_index, num_processes, is_main_process = "cpu", 0, 1, True

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, directory: str) -> None:
        shards = Path(directory) / "pytorch_model"
        shards.mkdir(parents=True)
        for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            (shards / name).write_bytes(b"shard")
        (Path(directory) / "random_states_0.pkl").write_bytes(b"rng")


def test_a_checkpoint_is_on_storage_before_its_manifest_vouches_for_it(tmp_path, monkeypatch):
    """Nothing was synced: after a power loss the rename and the manifest could reach the disk before the shards'
    pages did, a published checkpoint of empty files (caught at resume by the checksums, but with the older
    checkpoints already rotated away). Each rank now syncs its files as it hashes them, the main process every
    directory before the manifest, and output_dir after the rename."""
    import os

    from recipes.training.checkpointing import save_checkpoint

    synced = []
    real_fsync = os.fsync

    def record(descriptor):
        synced.append(Path(os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", record)
    beats = []
    final = save_checkpoint(OneRankSaving(), tmp_path, 7, {"run_state": {}}, {"config.yaml": "a: 1\n"},
                            progress=lambda: beats.append(len(synced)))  # fmt: skip
    assert final == tmp_path / "checkpoint-7" and manifest_problems(final) == [] and verify_checksums(final) == []
    staging = tmp_path / ".checkpoint-7.tmp"
    manifest_at = synced.index(staging / ".manifest.json.tmp")
    before = set(synced[:manifest_at])
    written = [staging / path.relative_to(final) for path in final.rglob("*") if path.name != "manifest.json"]
    assert written and all(path in before for path in written), "every file and directory, before the manifest"
    assert staging in before and synced[-1] == tmp_path, "the rename and `latest` are made durable last"
    # the hang watchdog's beat: before and after the writes, and after each file synced and hashed (~120 GB per rank
    # at 70B: a save used to have to fit in one hang_timeout_s, and a slow file system made every save a "hang")
    files = [path for path in final.rglob("*") if path.is_file() and path.name != "manifest.json"]
    assert len(beats) == 2 + len(files) and beats[0] == beats[1] == 0 and beats[2:] == sorted(set(beats[2:]))


def test_the_trainer_beats_its_callbacks_through_checkpoint_io(tmp_path):
    """The Trainer hands the checkpointer its callbacks' `on_checkpoint_io` (the watchdog re-arms there)."""
    import types

    from recipes.config import load_config
    from recipes.training.callbacks import Callback
    from recipes.training.checkpointing import Checkpointer
    from recipes.training.trainer import Trainer
    from tests.conftest import TINY_RECIPE

    class Counting(Callback):
        calls = 0

        def on_checkpoint_io(self, trainer) -> None:
            Counting.calls += 1

    accelerator = types.SimpleNamespace(num_processes=1, device="cpu")
    checkpointer = Checkpointer(accelerator, None, tmp_path, None, {}, {})
    Trainer(load_config(TINY_RECIPE, []), accelerator, None, None, data=None, checkpointer=checkpointer, metrics=None,
            signals=None, state=None, callbacks=[Counting()], masking=None, num_parameters=1)  # fmt: skip
    checkpointer.progress()
    assert Counting.calls == 1


def _convert_where_views_differ(rank, checkpoint, outcome_dir):
    """ensure_universal on a node that sees universal/ (rank 0) and one whose file system lags (rank 1)."""
    import torch.distributed as dist

    from recipes.training import elastic, universal

    universal.has_universal = lambda path: rank == 0

    class Rank:
        is_main_process = rank == 0

        def wait_for_everyone(self) -> None:
            dist.barrier()

    def verify(path):  # a collective, as the resume's re-hash is
        shares = [None, None]
        dist.all_gather_object(shares, [])
        return [problem for share in shares for problem in share]

    elastic.ensure_universal(Path(checkpoint), Rank(), verify)
    (Path(outcome_dir) / f"rank-{rank}-returned").touch()


@pytest.mark.multiprocess
def test_a_lagging_node_takes_the_main_process_view_of_a_universal_conversion(tmp_path):
    """Each rank asked its own file system whether the checkpoint had a universal/, and the answer chose between a
    collective re-hash and a barrier: a node whose NFS view lagged took the other branch (a hang, or gloo's
    mismatched-collective error). Every rank now takes the main process's answer."""
    from gloo_ranks import on_ranks

    on_ranks(_convert_where_views_differ, 2, tmp_path, str(tmp_path / "checkpoint-6"), str(tmp_path), timeout_s=20)
    assert sorted(path.name for path in tmp_path.glob("rank-*")) == ["rank-0-returned", "rank-1-returned"]


def test_a_rotation_killed_half_way_leaves_what_the_next_start_removes(tmp_path, monkeypatch):
    """A deletion killed inside rmtree left `checkpoint-N` with some files gone: no longer complete, so no rotation
    counted it again, and no start removed it (~1 TB each at 70B, unseen by the free-space check). Rotation now
    renames it out of the pattern first, and the next start removes what a killed deletion left."""
    import shutil

    from recipes.training.checkpointing import checkpoint_dirs, rotate_checkpoints
    from recipes.training.output_dir import remove_stale_checkpoint_staging

    for step in (100, 200, 300):
        make_checkpoint(tmp_path, step)
    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", lambda path, ignore_errors=False: None)  # killed inside it
        assert rotate_checkpoints(OneRankSaving(), tmp_path, 2, None) == [tmp_path / "checkpoint-100"]
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-200", "checkpoint-300"]
    # and a universal conversion killed half-way (a start at the old world size never converts, so never removed it)
    (tmp_path / "checkpoint-200" / ".universal.tmp-4242" / "pytorch_model").mkdir(parents=True)
    removed = [str(p.relative_to(tmp_path)) for p, _ in remove_stale_checkpoint_staging(tmp_path)]
    assert removed == [".checkpoint-100.deleting", "checkpoint-200/.universal.tmp-4242"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-200", "checkpoint-300"]
    assert manifest_problems(tmp_path / "checkpoint-200") == []


def test_early_stopping_exports_the_best_checkpoint_only_once_it_is_re_hashed(tmp_path, monkeypatch):
    """final/ after early stopping came from the best checkpoint unread: one saved by an earlier launch, maybe weeks
    before, whose damage of the same size gave wrong weights and no error. It is re-hashed now (unless this launch
    saved or loaded it), and a damaged one gives way to this step's checkpoint, with a warning."""
    import types

    from recipes import export
    from recipes.training.checkpointing import Checkpointer
    from recipes.training.run_state import Stop, StopReason

    best, newest = make_checkpoint(tmp_path, 100), make_checkpoint(tmp_path, 300)
    exported = []
    monkeypatch.setattr(export, "export_checkpoint", lambda source, *args, **kwargs: exported.append(source.name))
    monkeypatch.setattr(export, "_write_record", lambda *args: None)
    monkeypatch.setattr(export, "_host_peaks", lambda: [])
    checkpointer = Checkpointer(OneRankSaving(), None, tmp_path, None, {}, {})
    checkpointer.verified.add(newest)
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(best_checkpoint=best.name), save=lambda: newest,
                                    checkpointer=checkpointer, accelerator=OneRankSaving(),
                                    signals=types.SimpleNamespace(received=None))  # fmt: skip
    config = types.SimpleNamespace(output_dir=str(tmp_path), bf16=True, fp16=False, tokenizer_name_or_path="t")
    launch = types.SimpleNamespace(inputs=types.SimpleNamespace(tokenizer=None))
    stop = Stop(StopReason.EARLY_STOPPING)
    next((best / "pytorch_model").iterdir()).write_bytes(b"WEIGHTS")  # same size, other bytes
    export.export_run(config, launch, trainer, stop)
    assert exported == ["checkpoint-300"] and best not in checkpointer.verified
    make_checkpoint(tmp_path / "again", 100)
    shutil.copytree(tmp_path / "again" / "checkpoint-100", best, dirs_exist_ok=True)  # restored
    export.export_run(config, launch, trainer, stop)
    assert exported == ["checkpoint-300", "checkpoint-100"] and best in checkpointer.verified


def test_checkpoint_named_directories_of_another_tool_do_not_block_a_fresh_start(tmp_path):
    """Refusing a used output_dir whose checkpoints all fail must not refuse one that holds only directories another
    tool named `checkpoint-N` (no manifest): those are passed over, as before, with a note."""
    (tmp_path / "checkpoint-500").mkdir()
    (tmp_path / "checkpoint-500" / "pytorch_model.bin").write_bytes(b"someone else's")
    path, notes = find_resume_checkpoint(tmp_path, "auto")
    assert path is None and "no manifest.json" in notes[0]


def test_what_was_set_aside_as_damaged_is_named_with_its_size_at_each_start(tmp_path):
    """Set-aside copies are never deleted by the run (someone may restore them) and are not in its disk plan: each
    start names them and their size, so that a full disk later is not a surprise."""
    from recipes.training.output_dir import kept_aside

    make_checkpoint(tmp_path, 100, payload=b"x" * 1000).rename(tmp_path / "checkpoint-100.damaged")
    converted = make_checkpoint(tmp_path, 200) / "universal.damaged-2" / "zero"
    converted.mkdir(parents=True)
    (converted / "fp32.pt").write_bytes(b"y" * 500)
    assert [(path.relative_to(tmp_path).as_posix(), size) for path, size in kept_aside(tmp_path)] == [
        ("checkpoint-100.damaged", 1000 + len((tmp_path / "checkpoint-100.damaged" / "manifest.json").read_bytes())),
        ("checkpoint-200/universal.damaged-2", 500),
    ]


def test_the_watchdog_times_a_save_but_not_the_load_before_the_first_step(monkeypatch):
    """The save's beats re-arm a running timer; the resume's load comes before the first step (an elastic one reads
    ~840 GB per rank at 70B) and must not start one: it would end a long load as a "hang"."""
    import faulthandler
    import types

    import torch

    from recipes.training.callbacks import HangWatchdog

    armed = []
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda timeout, exit: armed.append(timeout))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: armed.append("off"))
    watchdog = HangWatchdog(1800)
    trainer = types.SimpleNamespace(model=torch.nn.Linear(2, 2),
                                    accelerator=types.SimpleNamespace(unwrap_model=lambda model: model))  # fmt: skip
    watchdog.on_checkpoint_io(trainer)  # the resume's load
    assert armed == []
    watchdog.on_train_start(trainer)
    watchdog.on_checkpoint_io(trainer)  # a save
    assert armed == [1800, 1800]
    watchdog.on_train_end(trainer, None)
    watchdog.on_save(trainer, None)  # the final save, after the loop: the export that follows is not timed
    watchdog.on_checkpoint_io(trainer)
    assert armed == [1800, 1800, "off"]


def test_an_error_reading_the_main_process_view_is_raised_as_it_was():
    """main_process_view raises rank 0's error on every rank; on rank 0 it is the original (a full disk keeps its
    errno, and so its exit code 4)."""
    import errno

    from common.collectives import main_process_view

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as raised:
        main_process_view(full)
    assert raised.value.errno == errno.ENOSPC


def test_a_converter_killed_by_a_signal_is_a_failure_to_retry_not_a_bad_input(tmp_path, monkeypatch):
    """The out-of-memory killer or a stop ending ds_to_universal gave CheckpointError, exit 2, which the Slurm scripts
    never requeue; a converter that failed on its own still is one (the same checkpoint fails the same way)."""
    import subprocess

    from recipes.training import elastic
    from recipes.training.checkpointing import CheckpointError

    checkpoint = make_checkpoint(tmp_path, 6)
    (checkpoint / "pytorch_model" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"state")
    for code, error in ((-9, RuntimeError), (1, CheckpointError)):
        monkeypatch.setattr(elastic.subprocess, "run", lambda *a, code=code, **k: subprocess.CompletedProcess(
            a, code, "", "Killed" if code < 0 else "ValueError: bad shard"))  # fmt: skip
        with pytest.raises(error, match=f"failed \\(exit {code}\\)") as raised:
            elastic.convert(checkpoint, attempt="this start")
        assert type(raised.value) is error
        said = json.loads((checkpoint / elastic.FAILED).read_text())
        assert said["attempt"] == "this start" and said["message"] == str(raised.value)


def test_a_resume_with_document_masking_or_the_precision_changed_is_another_run():
    """Neither was in the run's identity: early stopping then compared eval losses of two attention rules, and a bf16
    run resumed in fp16 took over bf16's static loss scale of 1 (no dynamic scaling, gradients underflowing)."""
    from recipes.training.resume import identity_changes

    saved = {"document_masking": False, "precision": "bf16", "text_field": "text"}
    changes = identity_changes(saved, {**saved, "document_masking": True, "precision": "fp16"})
    assert [change.split(" (")[0] for change in changes] == [
        "document_masking: false -> true",
        "precision: bf16 -> fp16",
    ]
    assert identity_changes({"text_field": "text"}, {**saved}) == [], "checkpoints from before they were recorded"

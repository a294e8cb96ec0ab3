"""The loop's decisions, on the Validation callback and the real Trainer loop with stand-in parts (one process,
no model): which checkpoint is the best, when the run stops, that a relaunch of a stopped run stays stopped, and
what counts as step time."""

import types

import pytest
import torch

from recipes.training import callbacks
from recipes.training.interface import Control
from recipes.training.run_state import RunState, StopReason

ROWS = torch.zeros(1, 8, dtype=torch.long)


class Saves:
    """The part of a trainer the Validation callback uses."""

    def __init__(self, state):
        self.state, self.saved = state, []
        self.metrics = types.SimpleNamespace(write=lambda step, record: None)
        self.accelerator = self.model = None

    def due(self, interval):
        return True

    def save(self):
        self.saved.append(self.state.step)


def evaluate(monkeypatch, losses, patience, threshold):
    """The callback over one evaluation per loss, at steps 1000, 2000, ...: (trainer, stop or None at each)."""
    remaining = iter(losses)
    monkeypatch.setattr(callbacks, "validation_loss", lambda *args, **kwargs: next(remaining))
    validation = callbacks.Validation(ROWS, 1000, 1, None, patience=patience, threshold=threshold)
    trainer, stops = Saves(RunState()), []
    for index in range(len(losses)):
        trainer.state.step = 1000 * (index + 1)
        control = Control()
        validation.on_step_end(trainer, None, control)
        stops.append(control.stop)
    return trainer, stops


def test_the_best_checkpoint_is_the_lowest_loss_and_the_threshold_only_counts_patience(monkeypatch):
    """With early_stopping_threshold > 0 the best moved only on an improvement larger than the threshold: a run that
    improved by less each time exported its first checkpoint (and protected it from rotation over better ones)."""
    trainer, stops = evaluate(monkeypatch, [2.000, 1.995, 1.992, 1.991], patience=3, threshold=0.01)
    assert trainer.state.best_eval_loss == 1.991 and trainer.state.best_checkpoint == "checkpoint-4000"
    assert trainer.saved[:4] == [1000, 2000, 3000, 4000]  # each new best is saved when it is measured
    assert stops[:3] == [None, None, None] and stops[3].reason is StopReason.EARLY_STOPPING
    assert "larger than 0.01 in 3 evaluations (best 1.9910 at checkpoint-4000)" in str(stops[3])
    trainer, stops = evaluate(monkeypatch, [2.0, 1.5, 1.6, 1.4, 1.45], patience=2, threshold=0.0)
    assert trainer.state.best_checkpoint == "checkpoint-4000" and stops == [None] * 5


def test_a_relaunch_of_a_run_that_stopped_early_stays_stopped(monkeypatch):
    """Nothing kept an early stop: a relaunch (the requeue after a stop signal cut the best model's export, or a
    crash) resumed below max_steps and trained on, ~1,000 steps at 70B before it stopped again, or never did. The
    relaunch now stops before its first step and exports, as the first launch would have."""
    from recipes.config import load_config
    from recipes.training.attention import DocumentMasking
    from recipes.training.trainer import Trainer
    from tests.conftest import TINY_RECIPE

    config = load_config(TINY_RECIPE, ["--max_steps", "100"])
    stopped = RunState(step=20, best_eval_loss=2.0, evaluations_without_improvement=3,
                       best_checkpoint="checkpoint-5", validation_sha256=callbacks.rows_sha256(ROWS))  # fmt: skip

    class Trained(Exception):
        pass

    def take(count):
        raise Trained

    accelerator = types.SimpleNamespace(device="cpu", num_processes=1, is_main_process=True)
    data = types.SimpleNamespace(peek=lambda count: True, take=take)
    checkpointer = types.SimpleNamespace(progress=None, last=None)

    def trainer_for(patience, state):
        validation = callbacks.Validation(ROWS, 5, 1, None, patience=patience, threshold=0.0)
        return Trainer(config, accelerator, types.SimpleNamespace(train=lambda: None), None, data=data,
                       checkpointer=checkpointer, metrics=None, signals=types.SimpleNamespace(received=None),
                       state=state, callbacks=[validation], masking=DocumentMasking(None, "sdpa"),
                       num_parameters=1)  # fmt: skip

    monkeypatch.setattr("recipes.training.trainer.any_rank", lambda flags, device: flags)
    stop = trainer_for(3, stopped).fit()
    assert stop.reason is StopReason.EARLY_STOPPING  # before any batch was taken
    assert "in 3 evaluations (best 2.0000 at checkpoint-5)" in str(stop)
    # patience raised in the recipe on relaunch: a person chose to train on
    with pytest.raises(Trained):  # the loop takes its step's batches
        trainer_for(5, stopped).fit()


def test_waiting_for_data_is_step_time_and_is_logged_as_such(monkeypatch):
    """The step timer ran inside the forward and backward only, while the next step's batches were read (and waited
    for, on the slowest rank's loader) after it: a run held back by its data reported full speed (157 tokens/s where
    14.5 were trained)."""
    import time

    from recipes.config import load_config
    from recipes.training.attention import DocumentMasking
    from recipes.training.trainer import Trainer
    from tests.conftest import TINY_RECIPE

    config = load_config(TINY_RECIPE, ["--max_steps", "3", "--gradient_accumulation_steps", "1"])
    accelerator = types.SimpleNamespace(device="cpu", num_processes=1, is_main_process=True, sync_gradients=True,
                                        backward=lambda loss: None)  # fmt: skip
    forward = types.SimpleNamespace(loss=torch.tensor(2.0))

    class Model:
        def train(self):
            pass

        def __call__(self, **inputs):
            return forward

        def get_global_grad_norm(self):
            return 1.0

    def peek(count):
        time.sleep(0.2)  # the loader's wait for the next step's batches
        return True

    data = types.SimpleNamespace(peek=peek, take=lambda count: [torch.zeros(1, 8, dtype=torch.long)] * count)
    trainer = Trainer(config, accelerator, Model(), types.SimpleNamespace(param_groups=[{}]), data=data,
                      checkpointer=types.SimpleNamespace(progress=None, last=None), metrics=None,
                      signals=types.SimpleNamespace(received=None), state=RunState(), callbacks=[],
                      masking=DocumentMasking(None, "sdpa"), num_parameters=1)  # fmt: skip
    monkeypatch.setattr("recipes.training.trainer.any_rank", lambda flags, device: flags)
    trainer.fit()
    assert trainer.state.step == 3
    # three reads, before the first step and after each but the last: all of them step time
    assert trainer.window.data_seconds >= 3 * 0.2 - 0.01 and trainer.window.seconds >= trainer.window.data_seconds


def test_an_evaluation_that_does_not_stop_leaves_an_earlier_callbacks_stop_standing(monkeypatch):
    from recipes.training.run_state import Stop

    monkeypatch.setattr(callbacks, "validation_loss", lambda *args, **kwargs: 1.0)
    trainer = Saves(RunState(step=1000))
    control = Control(stop=Stop(StopReason.MAX_STEPS, "an earlier callback's"))
    callbacks.Validation(ROWS, 1000, 1, None, patience=3, threshold=0.0).on_step_end(trainer, None, control)
    assert control.stop == Stop(StopReason.MAX_STEPS, "an earlier callback's")


def test_a_resume_says_what_of_the_recipe_changed_and_takes_the_recipes_optimizer_settings(tmp_path):
    """Nothing said what a resume applied of an edited recipe or a forgotten flag (warmup 35,000 -> 10,000 at step
    5,000 moved the learning rate from 1.4e-5 to 5e-5); and the optimizer's load put the saved groups back whole, so
    a lowered weight_decay was ignored at the same world size and taken at the next change of it."""
    import logging

    import yaml

    from recipes.training.model import group_hyperparameters, hyperparameter_changes, restore_group_hyperparameters
    from recipes.training.resume import changes_line

    checkpoint = tmp_path / "checkpoint-5000"
    checkpoint.mkdir()
    saved = {"learning_rate": 1e-4, "warmup_steps": 35000, "model_config": {"num_hidden_layers": 80},
             "resume_from_checkpoint": "auto"}  # fmt: skip
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(saved))
    level, line = changes_line(checkpoint, {**saved, "warmup_steps": 10000, "resume_from_checkpoint": "none"})
    assert (
        level == logging.WARNING
        and line == "resume: recipe changed since checkpoint-5000: warmup_steps: 35000 -> 10000"
    )
    assert changes_line(checkpoint, saved) == (logging.INFO, "resume: recipe changed since checkpoint-5000: nothing")

    weights = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))]
    before = torch.optim.AdamW(
        [{"params": weights[:1], "weight_decay": 0.1}, {"params": weights[1:], "weight_decay": 0.0}]
    )
    groups = [{"params": weights[:1], "weight_decay": 0.05}, {"params": weights[1:], "weight_decay": 0.0}]
    after = torch.optim.AdamW(groups, eps=1e-6)
    built = group_hyperparameters(after)
    after.load_state_dict(before.state_dict())  # what a same-world resume's load does
    assert after.param_groups[0]["weight_decay"] == 0.1, "torch puts the saved group back whole"
    assert hyperparameter_changes(group_hyperparameters(after), built) == ["eps 1e-08 -> 1e-06",
                                                                           "weight_decay 0.1 -> 0.05"]  # fmt: skip
    restore_group_hyperparameters(after, built)
    assert [group["weight_decay"] for group in after.param_groups] == [0.05, 0.0] and after.param_groups[0][
        "eps"
    ] == 1e-6


def test_a_raw_text_resume_with_another_micro_batch_and_several_workers_is_refused():
    """The global batch was pinned, so micro 4 x accumulation 2 resumed as 8 x 1 passed every check; with 2
    dataloader workers taking turns by micro-batch, the position then trained 4 of the next 24 rows twice and
    skipped 4 (the natural fix after an out-of-memory error)."""
    from recipes.training.train_data import DataKind, TrainData

    launch = types.SimpleNamespace(world=2, num_workers=2, micro_batch=8, sharding="file")
    saved = {"kind": DataKind.STREAM.value, "world_size": 2, "dataloader_num_workers": 2, "sharding": "file"}
    problem = TrainData.resume_problem(launch, {**saved, "micro_batch": 4})
    assert problem.startswith("per_device_train_batch_size 4 -> 8: dataloader workers take turns by micro-batch")
    assert TrainData.resume_problem(launch, {**saved, "micro_batch": 8}) is None
    assert TrainData.resume_problem(launch, saved) is None, "a position from before it was recorded"
    one_worker = types.SimpleNamespace(**{**vars(launch), "num_workers": 1})
    assert TrainData.resume_problem(one_worker, {**saved, "dataloader_num_workers": 1, "micro_batch": 4}) is None

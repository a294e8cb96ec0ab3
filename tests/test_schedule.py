import math

import pytest
import torch
from transformers import get_scheduler

from recipes.config import load_config
from recipes.training.schedule import lr_at_step
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [("cosine_with_min_lr", {"min_lr": 1e-5}), ("cosine", {}), ("constant_with_warmup", {})],
)
def test_matches_transformers_schedule_at_every_step(kind, kwargs):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1e-4)
    reference = get_scheduler(
        kind, optimizer, num_warmup_steps=10, num_training_steps=100, scheduler_specific_kwargs=kwargs
    )
    for step in range(101):
        ours = lr_at_step(
            step,
            learning_rate=1e-4,
            warmup_steps=10,
            total_steps=100,
            lr_scheduler_type=kind,
            min_lr=kwargs.get("min_lr", 0.0),
        )
        assert ours == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-9, abs=1e-15), step
        optimizer.step()
        reference.step()


def test_spec_run_schedule_at_known_steps():
    config = load_config(REPO / "recipes/configs/llama70b_a800x8.yaml")
    total = config.total_steps(world_size=8)

    def lr(step):
        return lr_at_step(
            step,
            learning_rate=config.learning_rate,
            warmup_steps=config.warmup_steps,
            total_steps=total,
            lr_scheduler_type=config.lr_scheduler_type,
            min_lr=config.lr_scheduler_kwargs["min_lr"],
        )

    assert lr(0) == 0.0
    assert lr(17_500) == pytest.approx(5e-5)
    assert lr(35_000) == pytest.approx(1e-4)
    midpoint = 35_000 + (total - 35_000) // 2
    assert lr(midpoint) == pytest.approx(5.5e-5, rel=1e-6)
    assert lr(total) == pytest.approx(1e-5)
    assert lr(total + 1000) == pytest.approx(1e-5), "past the end the rate stays at min_lr"
    assert all(lr(s) >= lr(s + 1) for s in range(35_000, total, total // 97))


def test_cosine_is_monotone_and_bounded():
    values = [lr_at_step(s, learning_rate=3e-3, warmup_steps=5, total_steps=50, min_lr=3e-4) for s in range(5, 51)]
    assert values[0] == pytest.approx(3e-3)
    assert values[-1] == pytest.approx(3e-4)
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert not any(math.isnan(v) for v in values)

"""Learning-rate schedule as a pure function of the optimizer step.

The loop sets the rate itself before every optimizer step instead of handing a scheduler to
`accelerator.prepare`: accelerate's scheduler wrapper steps `num_processes` times per optimizer
step unless batches are split, and a function of the step needs no state of its own to resume.
Values match `transformers.get_scheduler` for the same names (tests compare them).
"""

import math


def lr_at_step(
    step: int,
    *,
    learning_rate: float,
    warmup_steps: int,
    total_steps: int,
    lr_scheduler_type: str = "cosine_with_min_lr",
    min_lr: float = 0.0,
) -> float:
    """Learning rate for the optimizer step that has `step` completed steps before it."""
    if step < warmup_steps:
        return learning_rate * step / max(1, warmup_steps)
    if lr_scheduler_type == "constant_with_warmup":
        return learning_rate
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    if lr_scheduler_type == "cosine":
        return learning_rate * cosine
    if lr_scheduler_type == "cosine_with_min_lr":
        return min_lr + (learning_rate - min_lr) * cosine
    raise ValueError(f"unknown lr_scheduler_type {lr_scheduler_type!r}")


def recipe_lr(config, step: int, total_steps: int) -> float:
    """`lr_at_step` with the recipe's learning rate, warmup, schedule type and `lr_scheduler_kwargs.min_lr`."""
    return lr_at_step(
        step,
        learning_rate=config.learning_rate,
        warmup_steps=config.warmup_steps,
        total_steps=total_steps,
        lr_scheduler_type=config.lr_scheduler_type,
        min_lr=float(config.lr_scheduler_kwargs.get("min_lr", 0.0)),
    )

"""The training loop and its parts: the Trainer, its callbacks, checkpoints, data, model and start-up."""

"""The pretraining recipe: config, preflight, model, loop, checkpoints, export."""

"""Helpers that every layer may use: files written atomically, checksums, per-rank flag reductions.
Imports nothing from the project, so data_prep, eval and recipes can all depend on it."""

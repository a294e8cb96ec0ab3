"""Benchmarks run by hand; their numbers go to the README and issue notes, never into timed tests."""

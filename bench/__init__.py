"""Benchmarks: commands that print figures. Tests never assert on speed; these measure it."""

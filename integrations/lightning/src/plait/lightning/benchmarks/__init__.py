"""Benchmark suites of plait-lightning (``plait bench lightning``)."""

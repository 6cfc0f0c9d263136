"""Benchmarks, trace replay, profiles, simulator and planner."""

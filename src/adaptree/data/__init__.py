"""Benchmark and training prompts."""

"""Benchmarks: commands that write results files."""

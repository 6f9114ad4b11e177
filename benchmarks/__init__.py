"""Benchmarks: one folder per pipeline, each module run as `python -m benchmarks.<pipeline>.<module>` from
the repository root by a nox session; none is part of an installed package."""

"""Shared building blocks of the Ray Train reference pipelines."""

__version__ = "0.23.0"

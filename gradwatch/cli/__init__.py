"""The ``gradwatch`` command: argument parsing and dispatch, and the demo (the benchmark lives in ``benchmarks/``)."""

from .commands import main

__all__ = ["main"]

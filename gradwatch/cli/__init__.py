"""The ``gradwatch`` command: argument parsing and dispatch, and the demo (the benchmark lives in ``benchmarks/``)."""

from gradwatch.cli.commands import main

__all__ = ["main"]

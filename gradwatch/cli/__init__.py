"""The ``gradwatch`` command: argument parsing and dispatch, the demo, the benchmark."""

from .commands import main

__all__ = ["main"]

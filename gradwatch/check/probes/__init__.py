"""Probes: slopes of the objective along lines, one tensor at a time (``engine``, ``lines``), vmapped (``batched``),
or on a function's outputs (``outputs``); a disagreeing probe examined again (``reexamine``).
"""

"""Numerics: agreement measures, steps and central differences, the sampling of coordinates and directions, sketches.

Nothing here knows about models, hooks or logs.
"""

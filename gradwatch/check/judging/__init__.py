"""Judging: a tensor's samples turned into a verdict (bands, tolerances, the training judge) and the reports that carry them.
"""

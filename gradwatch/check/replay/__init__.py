"""The training reference: the step's objective replayed as training ran it (``reference``), its items and
weights (``items``, ``item_probe``), the cut step named (``cut``), per-row gradients (``rows``).
"""

"""The check objective and what keeps it a function: its terms (``terms``), random generators held still
(``rng``, ``generators``), dropout off (``dropout_off``, ``functional_dropout``), side-effect guards (``guards``), the float64
shadow (``shadow``), precision inside (``precision``), ``padding_idx`` rows (``padding_idx``), checkpointed graphs
(``checkpointed``), surrogates by design (``surrogate``), DTensor tests (``dtensor``).
"""

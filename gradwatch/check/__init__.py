"""The math of one check, in packages by job.

Bottom to top: ``numerics`` (differences, sampling), ``judging`` (verdicts, reports), ``objective`` (the
objective and what keeps it a function) and ``probes`` (slopes along lines), then ``replay`` (the training
reference), ``modules`` (localization, the module form) and ``independence``, ``backward``
(``check_backward``), ``higher_order`` (``check_double_backward``, inner derivatives) and ``model``
(``check_model``, ``check_numpy``) at the top. The public names are imported from :mod:`gradwatch`.
"""

"""Modules: a failure localized to a module (``localize``), the module form of a check (``module_form``),
and own-code copies of a module's forward (``own_code``).
"""

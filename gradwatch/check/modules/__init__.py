"""Modules: a failure localized to a module (``localize``), the module form of a check (``module_form``),
own-code copies of a module's forward (``own_code``) and the stubs standing for the modules it calls (``stubs``).
"""

"""Whose code a function is: an installed library's or the user's.

A module hook is part of the model when the library that makes the model registered it (transformers collects
router logits and hidden states with forward hooks), and an observer when the user's own code did (a recorder of
activations, a counter). :func:`library_of` tells them apart by where the function's code lives: in an installed
library (``site-packages`` or ``dist-packages``, the standard library, the interpreter itself) or elsewhere (the
script, ``__main__``, a notebook cell, a test file, the user's project, an editable install of it).

Example:
    >>> import json
    >>> library_of(json.dumps), library_of(lambda x: x)
    ('json', None)
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
import types
from typing import Any, Optional, Tuple

#: Directory names that hold installed distributions, wherever the environment is (a venv, conda, Debian's python3).
_INSTALL_DIRS = frozenset({"site-packages", "dist-packages"})
#: Modules of the standard library compiled into the interpreter or without a file (Python 3.10+ lists them all).
_STDLIB_NAMES = frozenset(getattr(sys, "stdlib_module_names", ())) | frozenset(sys.builtin_module_names)


def library_of(fn: Any) -> Optional[str]:
    """The top-level package of the installed library whose code ``fn`` is; None for the user's own code.

    ``fn`` may be a function, a closure, a bound method, a ``functools.partial`` (its function's), a builtin or a
    callable object (its class's). A library is code under an installation directory of the interpreter
    (``site-packages``/``dist-packages``: ``sysconfig``'s ``purelib``/``platlib``, :func:`site.getsitepackages`, the
    user site, or a directory of that name elsewhere) or of the standard library, or compiled into the
    interpreter. Code anywhere else is the user's: a script, ``__main__``, a notebook cell, a test file, the user's
    project, and the user's own package installed in editable mode (its files stay in the project).

    Example:
        >>> import torch
        >>> library_of(torch.nn.functional.relu), library_of(functools.partial(torch.nn.Module.__call__))
        ('torch', 'torch')
        >>> def mine(module, args, out): pass
        >>> library_of(mine) is None
        True
    """
    module, path = _source(fn)
    if module in (None, "__main__"):
        return None
    return _library(module, path)


def _source(fn: Any) -> Tuple[Optional[str], Optional[str]]:
    """``(module name, file)`` of the code ``fn`` runs; a file of None: no Python source (a builtin)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)  # a bound method: its function
    if isinstance(fn, types.FunctionType):
        return getattr(fn, "__module__", None), fn.__code__.co_filename
    if not isinstance(fn, (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
                           types.MethodDescriptorType)):
        fn = type(fn)  # a callable object: its class's code
    module = getattr(fn, "__module__", None)
    if not isinstance(module, str):
        owner = getattr(fn, "__objclass__", None)  # a slot wrapper: the class it belongs to
        module = getattr(owner, "__module__", None)
    if not isinstance(module, str):
        return None, None
    return module, getattr(sys.modules.get(module), "__file__", None)


@functools.lru_cache(maxsize=1024)
def _library(module: str, path: Optional[str]) -> Optional[str]:
    top = module.split(".")[0]
    if path is None:  # compiled into the interpreter (builtins, sys), or a module without a file
        return top if top in _STDLIB_NAMES else None
    if path.startswith("<frozen "):  # the standard library's frozen modules
        return top
    if path.startswith("<"):  # a notebook cell, exec'd or doctest code
        return None
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    if _INSTALL_DIRS.intersection(parts) or any(_under(real, d) for d in _library_dirs()):
        return top
    return None


def _under(path: str, directory: str) -> bool:
    return path.startswith(directory.rstrip(os.sep) + os.sep)


@functools.lru_cache(maxsize=1)
def _library_dirs() -> Tuple[str, ...]:
    """The interpreter's installation and standard-library directories, resolved."""
    found = []
    paths = sysconfig.get_paths()
    found += [paths[k] for k in ("purelib", "platlib", "stdlib", "platstdlib") if paths.get(k)]
    try:
        found += site.getsitepackages()
    except AttributeError:  # some embedded interpreters' site module lacks it
        pass
    user = getattr(site, "getusersitepackages", None)
    if callable(user):
        found.append(user())
    return tuple(sorted({os.path.realpath(d) for d in found if d}))

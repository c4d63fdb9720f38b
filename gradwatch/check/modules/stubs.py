"""Stand-ins for the modules an own-code unit calls, and what the own code reads of them.

A module's own code (:mod:`gradwatch.check.modules.own_code`) runs with each module it calls replaced by a
:class:`Stub` that hands back, call by call, the output that module gave in the live forward. Own code also
*reads* what it calls: ``len(block.resnets)`` (diffusers' ``UNet2DModel``), ``self.layers[0].self_attn.batch_first``
(torch's ``TransformerEncoder``), ``lora_A.weight.dtype`` (PEFT). A stub answers each read as the live module
would, by one rule: what is read can neither run nor change the live module.

- plain attributes (flags, sizes, configs) are the live module's;
- tensors (parameters, buffers, tensors kept as attributes) are constants: detached copies in the check's dtype on
  their device, made at the first read (:class:`LiveReads`). A ``dtype`` or ``device`` read is the copy's, and the
  own code may compute with them; the check does not differentiate with respect to them (the module's parameters
  are checked in its own unit);
- a submodule is the stub of that module where the own code calls it too, else a :class:`ModuleView`: it reads the
  same way, answers ``len``, iteration, indexing and ``isinstance`` as the module does, and refuses to be called
  (the live forward did not call it from this code);
- methods and properties of the module's class run with its view as ``self``, so what they read is read the same
  way and what they call is a stub (the module itself too, where it is stubbed).

Example:
    >>> import torch
    >>> from torch import nn
    >>> block = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    >>> stub = Stub("block", [torch.zeros(1, 3)], block)
    >>> len(stub), stub[0].out_features, stub[0].weight.dtype, isinstance(stub[0], nn.Linear)
    (2, 3, torch.float64, True)
    >>> stub(torch.ones(1, 2)).tolist()
    [[0.0, 0.0, 0.0]]
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Iterator, List, Mapping, MutableMapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from gradwatch.trees import rebuild, tensor_leaves

#: A module's dictionaries of registered members: read as dictionaries of what each member reads as.
MEMBERS = ("_parameters", "_buffers", "_modules")
_MISSING = object()


class ReplayMismatch(RuntimeError):
    """Own code that, run again, calls a module it did not call in the live forward, or calls one more often: the
    output that call gave is not known.

    Args:
        message: What happened.
        module: The module's name.
        more: True when it was called more often, False when it was not called at all.

    Example:
        >>> ReplayMismatch("called `b` twice", "b", more=True).module
        'b'
    """

    def __init__(self, message: str, module: str, more: bool = False) -> None:
        super().__init__(message)
        self.module, self.more = module, more


def constant(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A detached copy of ``t``, floating tensors in ``dtype`` (a copy even where ``t`` is of ``dtype`` already).

    Example:
        >>> w = nn.Parameter(torch.ones(2))
        >>> c = constant(w, torch.float64)
        >>> c.dtype, c.requires_grad, c.data_ptr() != w.data_ptr()
        (torch.float64, False, True)
    """
    return t.detach().to(dtype, copy=True) if t.is_floating_point() else t.detach().clone()


class LiveReads:
    """What the stubs of one own-code copy read of the live modules: the stubs by path, and each view and
    constant made once (two reads of one tensor give the same copy; a weight shared by two modules too).

    Args:
        root: The live module whose own code is checked (stub paths are relative to it).
        stubs: Relative name -> the stub standing for that module.
        dtype: The check's dtype (floating tensors read are copied in it).

    Example:
        >>> block = nn.Sequential(nn.Linear(2, 2))
        >>> reads = LiveReads(block)
        >>> reads.value(block[0].weight) is reads.value(block[0].weight), reads.value(3)
        (True, 3)
    """

    def __init__(self, root: nn.Module, stubs: Optional[Mapping[str, "Stub"]] = None,
                 dtype: torch.dtype = torch.float64) -> None:
        self.root = root
        # Weak: each stub and view holds these reads, and a cycle would keep the stubs' outputs (float64 logits of a
        # window over GPT-2's 50,257 tokens) held after the check until Python's full collection came round
        self.stubs: MutableMapping[str, Stub] = weakref.WeakValueDictionary(stubs or {})
        self.dtype = dtype
        self._paths: Optional[Dict[int, str]] = None
        self._views: MutableMapping[int, ModuleView] = weakref.WeakValueDictionary()
        self._constants: Dict[int, torch.Tensor] = {}
        self.pending: Set[Tuple[int, str]] = set()  # reads in a class's own ``__getattr__``, against a loop

    def path(self, module: nn.Module) -> Optional[str]:
        """``module``'s name relative to the root (its first, where it is shared), None outside the root."""
        if self._paths is None:  # one walk, at the first submodule read
            self._paths = {}
            for name, m in self.root.named_modules(remove_duplicate=False):
                self._paths.setdefault(id(m), name)
        return self._paths.get(id(module))

    def module(self, module: nn.Module) -> Any:
        """The stub standing for ``module`` where there is one, else its :class:`ModuleView`."""
        path = self.path(module)
        stub = self.stubs.get(path) if path is not None else None
        if stub is not None:
            return stub
        return self.view(module)

    def view(self, module: nn.Module) -> "ModuleView":
        """``module``'s :class:`ModuleView` (a stubbed module's too: its methods run on it, calls go to the stub)."""
        view = self._views.get(id(module))
        if view is None:
            view = self._views[id(module)] = ModuleView(module, self, self.path(module))
        return view

    def value(self, value: Any) -> Any:
        """What reading ``value`` off a live module gives the own code (the module docstring's rule)."""
        if isinstance(value, torch.Tensor):
            if id(value) not in self._constants:
                self._constants[id(value)] = constant(value, self.dtype)
            return self._constants[id(value)]
        if isinstance(value, nn.Module):
            return self.module(value)
        return value


def _class_attribute(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return _MISSING


def read(owner: Any, original: nn.Module, name: str, reads: LiveReads) -> Any:
    """``getattr(original, name)`` as ``owner`` (its view) reads it, in Python's order of lookup: a data descriptor
    of its class (a property) run with ``owner`` as ``self``; then its instance attributes; then any other class
    attribute (a method, bound to ``owner``); then its parameters, buffers and submodules; then the class's own
    ``__getattr__`` where it has one (PEFT's models forward what they lack to the model they wrap).

    Example:
        >>> fc = nn.Linear(2, 3)
        >>> reads = LiveReads(fc)
        >>> view = reads.module(fc)
        >>> read(view, fc, "in_features", reads), read(view, fc, "bias", reads).dtype
        (2, torch.float64)
    """
    cls = type(original)
    attr = _class_attribute(cls, name)
    kind = type(attr)
    if attr is not _MISSING and (hasattr(kind, "__set__") or hasattr(kind, "__delete__")):
        return attr.__get__(owner, cls)
    own = vars(original)
    if name in MEMBERS and name in own:
        return {k: reads.value(v) for k, v in own[name].items()}
    if name in own:
        return reads.value(own[name])
    if attr is not _MISSING:
        return attr.__get__(owner, cls) if hasattr(kind, "__get__") else reads.value(attr)
    for members in MEMBERS:
        found = own.get(members)
        if found is not None and name in found:
            return reads.value(found[name])
    fallback = _class_attribute(cls, "__getattr__")
    key = (id(owner), name)
    if fallback in (_MISSING, nn.Module.__getattr__) or key in reads.pending:
        raise AttributeError(f"'{cls.__name__}' object has no attribute '{name}'")
    reads.pending.add(key)
    try:
        return fallback(owner, name)
    finally:
        reads.pending.discard(key)


class _AsContainer:
    """``len``, iteration, indexing and truth of the live module a stub or view stands for, each item as read."""

    def _live_container(self) -> Any:
        original = self.__dict__.get("_stub_original")
        if original is None:
            raise TypeError(f"'{type(self).__name__}' object stands for no module")
        return original

    def __len__(self) -> int:
        return len(self._live_container())

    def __iter__(self) -> Iterator[Any]:
        reads = self.__dict__["_stub_reads"]
        return (reads.value(v) for v in iter(self._live_container()))

    def __getitem__(self, key: Any) -> Any:
        return self.__dict__["_stub_reads"].value(self._live_container()[key])

    def __bool__(self) -> bool:
        original = self.__dict__.get("_stub_original")
        return True if original is None else bool(original)


class ModuleView(_AsContainer):
    """A module below a stub that the own code reads but does not call (``block.resnets``, ``layer.self_attn``):
    its attributes read as the stub's (:func:`read`), ``isinstance`` of the module's class, never called.

    Example:
        >>> layer = nn.TransformerEncoderLayer(8, 2, 16)
        >>> view = LiveReads(layer).module(layer.self_attn)
        >>> view.batch_first, view.in_proj_weight.dtype, isinstance(view, nn.MultiheadAttention)
        (False, torch.float64, True)
    """

    def __init__(self, original: nn.Module, reads: LiveReads, path: Optional[str] = None) -> None:
        self.__dict__.update(_stub_original=original, _stub_reads=reads, _view_path=path)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105 - isinstance() of the module's class, as unittest.mock's spec does
        return type(self.__dict__["_stub_original"])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # copy, pickle and friends probe special names: the view has none of its own
        return read(self, self.__dict__["_stub_original"], name, self.__dict__["_stub_reads"])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        path = self.__dict__["_view_path"]
        stub = self.__dict__["_stub_reads"].stubs.get(path) if path is not None else None
        if stub is not None:  # a method of a stubbed module that calls the module
            return stub(*args, **kwargs)
        what = f"`{path}`" if path else type(self.__dict__["_stub_original"]).__name__
        raise ReplayMismatch(f"the own code called {what}, which it did not call in the live forward: its output there "
                             f"is not known", path or type(self.__dict__["_stub_original"]).__name__)

    def __repr__(self) -> str:
        return f"ModuleView({type(self.__dict__['_stub_original']).__name__})"


class Stub(nn.Module, _AsContainer):
    """Stands in for a module an own-code unit calls.

    Call ``k`` returns the output the module gave at its ``k``-th call in the live forward, its
    floating tensors as leaves (:attr:`outputs`, cloned at each call, so the own code may work in
    place), and records the floating tensors it was given in :attr:`given`. Any other attribute is the
    live module's as the module docstring says (:func:`read`); its ``training`` flag is the module's.

    Args:
        name: The stubbed module's full name (for messages).
        outputs: Its output at each call, already in the check's dtype.
        original: The live module it stands for (None: it answers no read).
        dtype: The check's dtype.
        reads: What the stubs of one copy share (default: a :class:`LiveReads` rooted at ``original``).

    Example:
        >>> stub = Stub("fc", [torch.ones(2)], nn.Linear(3, 2))
        >>> stub(torch.zeros(3)).tolist(), len(stub.given), stub.in_features, stub.weight.shape
        ([1.0, 1.0], 1, 3, torch.Size([2, 3]))
    """

    def __init__(self, name: str, outputs: Sequence[Any], original: Optional[nn.Module] = None,
                 dtype: torch.dtype = torch.float64, reads: Optional[LiveReads] = None) -> None:
        super().__init__()
        if original is not None and reads is None:
            reads = LiveReads(original, {}, dtype)
        # Not submodules: nothing of the live module is copied, cast or switched with the copy.
        self.__dict__.update(_stub_original=original, _stub_reads=reads)
        if original is not None:
            self.training = original.training
        self.stub_name = name
        self.stub_templates = list(outputs)
        self.outputs: List[List[nn.Parameter]] = []
        for k, out in enumerate(self.stub_templates):
            leaves = []
            for i, t in enumerate(t for t in tensor_leaves(out) if t.is_floating_point()):
                p = nn.Parameter(t.detach(), requires_grad=True)
                self.register_parameter(f"out{k}_{i}", p)
                leaves.append(p)
            self.outputs.append(leaves)
        self.stub_calls = 0
        self.given: List[torch.Tensor] = []

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original, reads = self.__dict__.get("_stub_original"), self.__dict__.get("_stub_reads")
            if original is None or reads is None or name.startswith("__") and name.endswith("__"):
                raise
            # Methods and properties run on the module's view, an instance of its class for ``isinstance`` and
            # ``super()`` (the stub itself is none: the check's guards must not take it for an Embedding or a Dropout).
            return read(reads.view(original), original, name, reads)

    def reset(self) -> None:
        """Before each evaluation: no call yet, nothing given."""
        self.stub_calls = 0
        self.given = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        k = self.stub_calls
        if k >= len(self.stub_templates):
            raise ReplayMismatch(f"`{self.stub_name}` was called {k + 1} times, more than in the live forward "
                                 f"({len(self.stub_templates)}): the own code does not compute the same thing twice",
                                 self.stub_name, more=True)
        self.stub_calls += 1
        self.given.extend(t for t in tensor_leaves((args, kwargs)) if t.is_floating_point())
        leaves = iter(self.outputs[k])
        return rebuild(self.stub_templates[k], lambda t: next(leaves).clone() if t.is_floating_point() else t)


class ModelStub(Stub):
    """Stands in for the whole model inside ``loss_fn``: calls return the model's live outputs (see
    :class:`Stub`); any other attribute (``model.config``, a submodule) is the live model's.

    Example:
        >>> stub = ModelStub(nn.Linear(2, 3), [torch.zeros(1, 3)])
        >>> stub(torch.ones(1, 2)).shape, stub.out_features
        (torch.Size([1, 3]), 3)
    """

    def __init__(self, model: nn.Module, outputs: Sequence[Any]) -> None:
        self.__dict__["_live"] = None  # set after the stub's own attributes exist
        super().__init__("<model>", outputs)
        self.__dict__["_live"] = model  # not a submodule: nothing of the live model is copied, cast or switched

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            live = self.__dict__.get("_live")
            if live is None:
                raise
            return getattr(live, name)

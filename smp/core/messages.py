"""Packing the arguments and results of cross-stage module calls into tensors.

A call's args/kwargs (or a module's output) may be any Python value that pickle can carry:
tensors, None, numbers and strings, tuples (named ones too), lists, dicts, dataclasses,
``ModelOutput``-style mappings, and objects of any other class — a Hugging Face ``DynamicCache``
or ``EncoderDecoderCache``, a config — with the tensors they hold. ``pack`` splits such a value
into

  - a *skeleton*: the value pickled with every tensor replaced by its slot number (Note
    [Tensors out of the pickle]), so the tensors travel as payload and never through pickle, and
  - the list of tensors, in the order pickle meets them (a tensor met twice is one slot),

and ``fill`` / ``unpack`` put them back together. Slots remember whether the tensor required
grad, so the receiving side knows which values enter the autograd graph. A module of the model
travels as its path and becomes the receiver's own instance of it; a module that
is not part of the model, or an object that pickle cannot carry (a lock, a lambda, an open
file), fails with a ``TypeError`` naming its type.

``pack`` may be given a ``resolve`` hook that sees every tensor first: it returns the tensor to
send, a :class:`Ref` when the receiver already holds the value (an output of an earlier call it
served, or a tensor an earlier request brought it), or a :class:`Sent` when the tensor is one
the receiver sent in the request being answered (used for arguments a module modified, whose
unchanged tensors need not travel back).
A Ref keeps its slot in the skeleton but sends no payload; a Sent takes no slot.
A :class:`Skeleton`'s ``blob`` (the pickle, without the slots' ``requires_grad`` flags) is the
value's structure: two values with equal structures differ only in their tensors.

Wire form of a skeleton (a uint8 tensor): 4 bytes little-endian slot count n, n bytes of
``requires_grad`` flags, then the pickle.
"""

from __future__ import annotations

import array
import collections
import collections.abc
import contextlib
import dataclasses
import functools
import hashlib
import io
import pickle
import struct
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "TensorSlot",
    "Ref",
    "Sent",
    "Skeleton",
    "pack",
    "pack_parts",
    "unpack",
    "fill",
    "slots",
    "slots_of",
    "describe",
    "digest",
    "fingerprint",
    "assign",
    "WriteBackError",
]

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_COUNT = struct.Struct("<I")


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Stands for the ``index``-th tensor of a packed message."""

    index: int
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class Ref:
    """A tensor the sender does not send: output ``slot`` of its call ``call_id``, which the
    receiver served (``stage`` −1) or which pipeline stage ``stage`` served (the receiver fetches
    it from there); with ``stage`` :data:`INPUT`, request slot ``slot`` of the receiver's served
    call ``call_id``: a tensor the sender sent before, unchanged since; with ``stage``
    :data:`CALLER`, slot ``slot`` of the request ``call_id`` being sent, which the sender keeps
    and the receiver fetches when it reads it. ``requires_grad`` is the slot's flag (an
    output's is decided by its producer, so False there)."""

    call_id: int
    slot: int
    stage: int = -1
    requires_grad: bool = False


INPUT = -2  # Ref.stage of a tensor the receiver got in an earlier request
CALLER = -3  # Ref.stage of a tensor the sender keeps until the receiver reads it


@dataclasses.dataclass(frozen=True)
class Sent:
    """In a reply: the tensor of request slot ``index``, which the receiver already holds."""

    index: int


@dataclasses.dataclass(frozen=True)
class Skeleton:
    """An unpacked skeleton: the pickle (``blob``) and the slots' ``requires_grad`` flags."""

    blob: bytes
    flags: tuple[bool, ...]

    @staticmethod
    def of(skeleton: torch.Tensor) -> Skeleton:
        raw = skeleton.numpy().tobytes()
        (n,) = _COUNT.unpack_from(raw)
        start = _COUNT.size
        return Skeleton(raw[start + n :], tuple(map(bool, raw[start : start + n])))


# Note [Tensors out of the pickle]
# A tensor, a module and a reply's request tensor leave the pickle as a call of one of the
# functions below with its slot number (path, request slot); unpickled, the call answers from
# the message that ``fill`` unpickles in this thread (``_loading``). Pickle offers two hooks for
# taking objects out: ``persistent_id``, which it calls, in Python, for every object it meets
# (each int, str and tuple of a ``DynamicCache`` too), and ``reducer_override``, which it skips
# for the types it pickles itself (None, bools, numbers, str, bytes, dict, list, tuple, set).
# With the second, packing a layer's output with an HF ``DynamicCache`` of 8 layers takes 35
# instead of 52 us and its fingerprint 30 instead of 53 us. It comes after pickle's memo, so a
# tensor that occurs twice in a value is one slot, and the receiver gets one tensor at both
# places, as the sender had.


_loading = threading.local()  # what the value being unpickled in this thread takes: _Frame


@dataclasses.dataclass
class _Frame:
    tensors: Any
    modules: Mapping[str, nn.Module] | None
    sent: Any


def _tensor_at(index: int):
    return _loading.frame.tensors[index]


def _sent_at(index: int):
    sent = _loading.frame.sent
    if sent is None:
        raise RuntimeError("smp: a reply names a request tensor, but none was given")
    return sent[index]


def _module_at(path: str):
    modules = _loading.frame.modules
    if modules is None:
        return _Shown(f"Module({path or '<root>'})")
    return modules[path]


class _Pickler(pickle.Pickler):
    """Pickles a value with its tensors and the model's modules taken out (Note [Tensors out of
    the pickle])."""

    def __init__(self, file, resolve, modules, local=None):
        super().__init__(file, protocol=_PROTOCOL)
        self.resolve, self.modules, self.local = resolve, modules, local
        self.tensors: list = []
        self.flags: list[bool] = []

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            if self.resolve is not None:
                obj = self.resolve(obj)
                if isinstance(obj, Sent):
                    return _sent_at, (obj.index,)
            self.tensors.append(obj)
            self.flags.append(_requires_grad(obj))
            return _tensor_at, (len(self.tensors) - 1,)
        if isinstance(obj, nn.Module):
            if self.local is not None:  # an in-process copy: modules stay themselves
                self.local.append(obj)
                return _module_at, (f"#{len(self.local) - 1}",)
            path = self.modules.get(id(obj)) if self.modules is not None else None
            if path is None:
                raise TypeError(
                    f"smp: a module of type {type(obj).__name__} that is not part of the "
                    "distributed model cannot cross pipeline stages; pass its outputs instead, "
                    "or make it a submodule of the model"
                )
            return _module_at, (path,)
        return NotImplemented


def _requires_grad(tensor: Any) -> bool:
    """A slot's flag. A placeholder of a tensor kept on another stage (a class with
    ``_smp_kept``: smp.pipeline.calls._Lazy) answers from what it stands for, without being
    fetched: taking a value apart (smp.core.tree) must not read it."""
    if type(tensor) is not torch.Tensor and getattr(type(tensor), "_smp_kept", False):
        return tensor._smp_grad
    return tensor.requires_grad


def _cannot_cross(value: Any, exc: BaseException) -> TypeError:
    return TypeError(
        f"smp: a value of type {type(value).__name__} cannot cross pipeline stages: {exc}. "
        "Module arguments and outputs may be tensors, Python values and objects that pickle "
        "can carry (with any tensors they hold); keep other objects on one stage (e.g. with "
        "smp.partition) or pass what they compute instead"
    )


def pack(
    value: Any,
    resolve: Callable | None = None,
    modules: Mapping[int, str] | None = None,
    local_modules: list | None = None,
) -> tuple[torch.Tensor, list]:
    """Returns (skeleton as a uint8 tensor, tensors in slot order): :func:`pack_parts` without
    the unpacked skeleton."""
    _, skeleton, tensors = pack_parts(value, resolve, modules, local_modules)
    return skeleton, tensors


def pack_parts(
    value: Any,
    resolve: Callable | None = None,
    modules: Mapping[int, str] | None = None,
    local_modules: list | None = None,
) -> tuple[Skeleton, torch.Tensor, list]:
    """Returns (the skeleton unpacked, as :meth:`Skeleton.of` would give it from the tensor;
    the skeleton as a uint8 tensor; the tensors in slot order); with ``resolve``, the list
    holds a :class:`Ref` where the hook returned one. ``modules`` maps ``id(module)`` to its path
    for the model's modules, which travel by path; with ``local_modules`` (a copy made in this
    process) every module is appended there instead and referred to by position.

    Raises:
        TypeError: a value that cannot cross stages (named by type).
    """
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, resolve, modules, local_modules)
    try:
        pickler.dump(value)
    except TypeError as exc:
        if str(exc).startswith("smp:"):
            raise
        raise _cannot_cross(value, exc) from exc
    except (pickle.PicklingError, AttributeError) as exc:
        raise _cannot_cross(value, exc) from exc
    flags = bytes(pickler.flags)
    pickled = buffer.getvalue()
    blob = _COUNT.pack(len(flags)) + flags + pickled
    unpacked = Skeleton(pickled, tuple(map(bool, flags)))
    return unpacked, torch.frombuffer(bytearray(blob), dtype=torch.uint8), pickler.tensors


def fill(
    skeleton: Skeleton,
    tensors: list,
    modules: Mapping[str, nn.Module] | None = None,
    sent: list | None = None,
) -> Any:
    """The value of ``skeleton`` with ``tensors[i]`` at slot i (any objects will do), the
    receiver's modules for module references and ``sent[i]`` for :class:`Sent` markers. Every
    call builds new objects."""
    outer = getattr(_loading, "frame", None)  # a fill inside a fill (an object's __setstate__)
    _loading.frame = _Frame(tensors, modules, sent)
    try:
        return pickle.loads(skeleton.blob)
    finally:
        _loading.frame = outer


def unpack(skeleton: torch.Tensor, tensors: list, modules=None, sent=None) -> Any:
    """Inverse of :func:`pack`."""
    return fill(Skeleton.of(skeleton), tensors, modules, sent)


def digest(blob: bytes) -> int:
    """A 64-bit fingerprint of a skeleton's ``blob`` (a signed integer: it travels in a header)."""
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little", signed=True)


def slots(skeleton: torch.Tensor) -> list[TensorSlot]:
    """The tensor slots of a packed skeleton, in tensor order."""
    return slots_of(Skeleton.of(skeleton))


def slots_of(skeleton: Skeleton) -> list[TensorSlot]:
    """The tensor slots of an unpacked skeleton, in tensor order."""
    return [TensorSlot(i, flag) for i, flag in enumerate(skeleton.flags)]


class _Shown:
    """A placeholder that :func:`describe` prints as its text."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def describe(skeleton: Skeleton) -> str:
    """A short description of a skeleton, e.g. ``tuple(Tensor, None, 3)``."""
    value = fill(skeleton, _SentShown("Tensor"), None, _SentShown("Tensor(request slot {})"))
    return _describe(value, 0)


class _SentShown:
    """Stands for a list of tensors whose items :func:`describe` shows by ``text``."""

    def __init__(self, text: str):
        self.text = text

    def __getitem__(self, index: int) -> _Shown:
        return _Shown(self.text.format(index))


def _describe(value: Any, depth: int) -> str:
    if depth > 4:
        return "..."
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        inner = ", ".join(f"{k}={_describe(v, depth + 1)}" for k, v in value._asdict().items())
        return f"{type(value).__name__}({inner})"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({', '.join(_describe(v, depth + 1) for v in value)})"
    if isinstance(value, Mapping):
        inner = ", ".join(f"{k}={_describe(v, depth + 1)}" for k, v in value.items())
        return f"{type(value).__name__}({inner})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = ", ".join(
            f"{f.name}={_describe(getattr(value, f.name), depth + 1)}"
            for f in dataclasses.fields(value)
        )
        return f"{type(value).__name__}({inner})"
    state = getattr(value, "__dict__", None)
    if state is not None and not isinstance(value, (_Shown, type)):
        inner = ", ".join(f"{k}={_describe(v, depth + 1)}" for k, v in state.items())
        return f"{type(value).__name__}({inner})"
    return repr(value)


# Values with nothing inside to walk (smp.core.tree's leaves; stateless here). torch.Size too:
# pytree would rebuild it as a plain tuple.
PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_PLAIN = PLAIN
_STATELESS = (torch.Tensor, *_PLAIN)


def fingerprint(value: Any) -> bytes | None:
    """The state of ``value`` as bytes, tensors by identity (not contents): equal before and
    after a module's forward iff the forward changed no attribute, item or element anywhere in
    it (replaced tensors count; in-place changes to a tensor's data do not). None for values
    that hold no mutable state (tensors, plain values) or that pickle cannot carry."""
    if isinstance(value, _STATELESS) or (
        type(value) is tuple and all(isinstance(v, _STATELESS) for v in value)
    ):
        return None  # a tuple of tensors (a rotary embedding's cos and sin) changes no item
    buffer = io.BytesIO()
    pickler = _IdentityPickler(buffer)
    try:
        pickler.dump(value)
    except (TypeError, pickle.PicklingError, AttributeError):
        return None
    return buffer.getvalue()


def _identity(kind: str, key: int):  # pragma: no cover - fingerprints are never unpickled
    raise RuntimeError("smp: a fingerprint is not a value")


class _IdentityPickler(pickle.Pickler):
    """Tensors and modules by identity (Note [Tensors out of the pickle])."""

    def __init__(self, file):
        super().__init__(file, protocol=_PROTOCOL)

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return _identity, ("tensor", id(obj))
        if isinstance(obj, nn.Module):
            return _identity, ("module", id(obj))
        return NotImplemented


class WriteBackError(TypeError):
    """A module on another stage changed an argument in a way that smp cannot write back into
    the caller's object (or tensor), so the caller would go on with a value one process would
    not have: the step fails on every rank instead (design.md §4.6)."""


def assign(target: Any, source: Any, what: str = "an argument") -> None:
    """Makes ``target`` hold what ``source`` holds, in place: the caller's argument takes the
    state that the module's forward left in the owner's copy of it (a cache that the module
    appended to). Mutable sequences (list, deque, bytearray, ``array.array``, numpy arrays of
    the same shape), mappings (dict and its subclasses, with a defaultdict's factory) and sets
    take the items; objects their attributes (``__dict__`` and ``__slots__``); tuples, immutable
    themselves, pass the assignment on to their items. The result is then compared with
    ``source`` by content (:func:`fingerprint`), so state that none of these reach (a C type's
    own, a custom ``__reduce__``'s) is refused, not dropped.

    Raises:
        WriteBackError: ``target`` cannot be given ``source``'s state in place (named with
            ``what``, e.g. "argument 1 of module 'blocks.0'").
    """
    if target is source:
        return
    if type(target) is not type(source):
        raise WriteBackError(
            f"smp: a module changed {what} of type {type(target).__name__} into "
            f"{type(source).__name__} in place on another pipeline stage; that cannot be "
            "carried back into the caller's object. Return the new value from the module instead"
        )
    if isinstance(target, tuple):
        for i, (t, s) in enumerate(zip(target, source)):
            if not isinstance(t, (torch.Tensor, *_PLAIN)):
                assign(t, s, f"item {i} of {what}")
        return
    before = None if _assigned_whole(type(target)) else fingerprint(source)
    # An array of another typecode raises: the check below names it.
    with contextlib.suppress(TypeError, ValueError):
        _assign_items(target, source)
    state = getattr(source, "__dict__", None)
    if state is not None:
        target.__dict__.clear()
        target.__dict__.update(state)
    for cls in type(source).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name in ("__dict__", "__weakref__"):
                continue
            if hasattr(source, name):
                object.__setattr__(target, name, getattr(source, name))
    # By content, not by type: whatever the rules above missed shows as a difference.
    if before is not None and fingerprint(target) != before:
        raise WriteBackError(
            f"smp: {what} (a {type(target).__qualname__}) was changed in place by a module on "
            "another pipeline stage, and smp cannot write that change back into the caller's "
            "object (its state is not items, attributes or slots that can be assigned). Pass "
            "a list, dict, set, deque, bytearray or an object whose attributes hold the state, "
            "or return the new value from the module"
        )


# Built-in types whose whole state _assign_items writes (a deque's maxlen cannot differ).
_ITEMS = (
    list, dict, set, bytearray, collections.deque, collections.OrderedDict,
    collections.defaultdict, collections.Counter,
)  # fmt: skip


@functools.cache
def _assigned_whole(cls: type) -> bool:
    """Whether :func:`assign` writes every part of a ``cls`` object's state, so the check by
    content can be skipped (it costs two fingerprints, ~100 us for a Hugging Face cache of 8
    layers): one of :data:`_ITEMS`, or a class of Python code over those or ``object`` that
    pickles by default (its state is its ``__dict__`` and slots). A class of C code, or one with
    its own ``__reduce__`` / ``__reduce_ex__`` / ``__getstate__``, is checked."""
    if cls in _ITEMS:
        return True
    for base in cls.__mro__:
        if base is object or base in _ITEMS:
            continue
        if not base.__flags__ & _HEAP_TYPE:  # a C type keeps state of its own
            return False
        if any(name in vars(base) for name in ("__reduce__", "__reduce_ex__", "__getstate__")):
            return False
    return True


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class created by a class statement


def _assign_items(target: Any, source: Any) -> None:
    """The items part of :func:`assign`, for the container types that hold items. A subclass's
    own methods are passed by where they may refuse (a ``ModelOutput``'s ``update`` raises) or
    do more than store (the source already holds their result)."""
    sequence = next((t for t in (list, bytearray, array.array) if isinstance(target, t)), None)
    if sequence is not None:
        sequence.__setitem__(target, slice(None), source)
    elif isinstance(target, collections.deque):
        collections.deque.clear(target)  # maxlen cannot change in place, nor differ here
        collections.deque.extend(target, source)
    elif isinstance(target, dict):
        base = collections.OrderedDict if isinstance(target, collections.OrderedDict) else dict
        base.clear(target)
        for key, value in base.items(source):
            base.__setitem__(target, key, value)
        if isinstance(target, collections.defaultdict):
            target.default_factory = source.default_factory
    elif isinstance(target, collections.abc.MutableMapping):
        target.clear()
        target.update(source)
    elif isinstance(target, set):
        set.clear(target)
        set.update(target, source)
    elif isinstance(target, collections.abc.MutableSet):
        target.clear()
        target |= source
    elif isinstance(target, collections.abc.MutableSequence):
        target.clear()
        target.extend(source)
    elif _is_array(target) and target.shape == source.shape and target.dtype == source.dtype:
        target[...] = source


def _is_array(value: Any) -> bool:
    """A numpy array (numpy is not imported for it: only a value of its type can be one)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray)

"""Packing the arguments and results of cross-stage module calls into tensors.

A call's args/kwargs (or a module's output) may be any nesting of tensors, None, Python scalars
and strings, tuples (named ones too), lists, dicts, dataclasses and ``ModelOutput``-style
mappings. ``pack`` splits such a value into

  - a *skeleton*: the same structure with every tensor replaced by a :class:`TensorSlot`,
    pickled into a uint8 tensor so it travels like any payload, and
  - the list of tensors, in a fixed depth-first order,

and ``unpack`` puts them back together. Slots remember whether the tensor required grad, so the
receiving side knows which values enter the autograd graph.

``pack`` may be given a ``resolve`` hook that sees every tensor first: it returns the tensor to
send, or a :class:`Ref` when the receiver already holds the value (an output of an earlier call
it served); a Ref keeps its slot in the skeleton but sends no payload. :func:`structure` is the
skeleton with every slot's ``requires_grad`` cleared, as bytes: two values with equal structures
differ only in their tensors.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "TensorSlot",
    "Ref",
    "pack",
    "unpack",
    "fill",
    "slots",
    "slots_of",
    "structure",
    "describe",
    "map_tensors",
]


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Stands for the ``index``-th tensor of a packed message."""

    index: int
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class Ref:
    """A tensor the sender does not send: output ``slot`` of its call ``call_id``, which the
    receiver served (``stage`` −1) or which pipeline stage ``stage`` served (the receiver fetches
    it from there)."""

    call_id: int
    slot: int
    stage: int = -1


def _strip(value: Any, tensors: list, resolve=None) -> Any:
    if isinstance(value, torch.Tensor):
        if resolve is not None:
            value = resolve(value)
            if isinstance(value, Ref):
                tensors.append(value)
                return TensorSlot(len(tensors) - 1, False)
        tensors.append(value)
        return TensorSlot(len(tensors) - 1, value.requires_grad)
    if value is None or isinstance(
        value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
    ):
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_strip(v, tensors, resolve) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_strip(v, tensors, resolve) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # ModelOutput-style classes are dataclasses and mappings; rebuild them from their fields.
        fields = {
            f.name: _strip(getattr(value, f.name), tensors, resolve)
            for f in dataclasses.fields(value)
        }
        return _Rebuild(type(value), fields)
    if isinstance(value, Mapping):
        items = {k: _strip(v, tensors, resolve) for k, v in value.items()}
        return items if type(value) is dict else _Rebuild(type(value), items)
    raise TypeError(
        f"smp: a value of type {type(value).__name__} cannot cross pipeline stages; module "
        "arguments and outputs may be tensors, None, numbers, strings, and tuples, lists, dicts "
        "or dataclasses of those"
    )


@dataclasses.dataclass
class _Rebuild:
    """A mapping or dataclass of type ``cls`` to rebuild from ``fields`` (keyword arguments)."""

    cls: type
    fields: dict


def _fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, TensorSlot):
        return tensors[skeleton.index]
    if isinstance(skeleton, _Rebuild):
        fields = {k: _fill(v, tensors) for k, v in skeleton.fields.items()}
        try:
            return skeleton.cls(**fields)
        except TypeError:
            return skeleton.cls(fields)
    if isinstance(skeleton, tuple) and hasattr(skeleton, "_fields"):
        return type(skeleton)(*(_fill(v, tensors) for v in skeleton))
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    return skeleton


def pack(value: Any, resolve=None) -> tuple[torch.Tensor, list]:
    """Returns (skeleton as a uint8 tensor, tensors in depth-first order); with ``resolve``, the
    list holds a :class:`Ref` where the hook returned one.

    Raises:
        TypeError: a value that cannot cross stages (named by type).
    """
    tensors: list = []
    skeleton = _strip(value, tensors, resolve)
    blob = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), tensors


def unpack(skeleton: torch.Tensor, tensors: list) -> Any:
    """Inverse of :func:`pack`."""
    return fill(pickle.loads(skeleton.numpy().tobytes()), tensors)


def fill(structure: Any, tensors: list) -> Any:
    """The value of an unpickled skeleton with ``tensors[i]`` at slot i (any objects will do)."""
    return _fill(structure, tensors)


def _cleared(node: Any) -> Any:
    if isinstance(node, TensorSlot):
        return TensorSlot(node.index, False)
    if isinstance(node, _Rebuild):
        return _Rebuild(node.cls, {k: _cleared(v) for k, v in node.fields.items()})
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*(_cleared(v) for v in node))
    if isinstance(node, (list, tuple)):
        return type(node)(_cleared(v) for v in node)
    if isinstance(node, dict):
        return {k: _cleared(v) for k, v in node.items()}
    return node


def structure(skeleton: torch.Tensor) -> tuple[bytes, Any]:
    """(bytes, object) of the skeleton with every slot's ``requires_grad`` cleared."""
    cleared = _cleared(pickle.loads(skeleton.numpy().tobytes()))
    return pickle.dumps(cleared, protocol=pickle.HIGHEST_PROTOCOL), cleared


def map_tensors(value: Any, fn) -> Any:
    """``value`` rebuilt with every tensor ``t`` (in containers :func:`pack` accepts) replaced
    by ``fn(t)``; values of other types are kept as they are."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: map_tensors(getattr(value, f.name), fn) for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, Mapping):
        items = {k: map_tensors(v, fn) for k, v in value.items()}
        try:
            return type(value)(**items)
        except TypeError:
            return type(value)(items)
    return value


def slots(skeleton: torch.Tensor) -> list[TensorSlot]:
    """The tensor slots of a packed skeleton, in tensor order."""
    return slots_of(pickle.loads(skeleton.numpy().tobytes()))


def describe(structure: Any) -> str:
    """A short description of an unpickled skeleton, e.g. ``tuple(Tensor, None, 3)``."""
    if isinstance(structure, TensorSlot):
        return "Tensor"
    if isinstance(structure, _Rebuild):
        inner = ", ".join(f"{k}={describe(v)}" for k, v in structure.fields.items())
        return f"{structure.cls.__name__}({inner})"
    if isinstance(structure, (list, tuple)):
        return f"{type(structure).__name__}({', '.join(describe(v) for v in structure)})"
    if isinstance(structure, dict):
        return "dict(" + ", ".join(f"{k}={describe(v)}" for k, v in structure.items()) + ")"
    return repr(structure)


def slots_of(structure: Any) -> list[TensorSlot]:
    """The tensor slots of an unpickled skeleton, in tensor order."""
    found: list[TensorSlot] = []
    _collect_slots(structure, found)
    return sorted(found, key=lambda s: s.index)


def _collect_slots(node: Any, found: list[TensorSlot]) -> None:
    # A module-level function: a nested recursive one is a reference cycle per call.
    if isinstance(node, TensorSlot):
        found.append(node)
    elif isinstance(node, _Rebuild):
        for v in node.fields.values():
            _collect_slots(v, found)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _collect_slots(v, found)
    elif isinstance(node, dict):
        for v in node.values():
            _collect_slots(v, found)

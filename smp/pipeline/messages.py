"""Packing the arguments and results of cross-stage module calls into tensors.

A call's args/kwargs (or a module's output) may be any nesting of tensors, None, Python scalars
and strings, tuples (named ones too), lists, dicts, dataclasses and ``ModelOutput``-style
mappings. ``pack`` splits such a value into

  - a *skeleton*: the same structure with every tensor replaced by a :class:`TensorSlot`,
    pickled into a uint8 tensor so it travels like any payload, and
  - the list of tensors, in a fixed depth-first order,

and ``unpack`` puts them back together. Slots remember whether the tensor required grad, so the
receiving side knows which values enter the autograd graph.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["TensorSlot", "pack", "unpack", "slots"]


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Stands for the ``index``-th tensor of a packed message."""

    index: int
    requires_grad: bool


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return TensorSlot(len(tensors) - 1, value.requires_grad)
    if value is None or isinstance(
        value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
    ):
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_strip(v, tensors) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_strip(v, tensors) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # ModelOutput-style classes are dataclasses and mappings; rebuild them from their fields.
        fields = {
            f.name: _strip(getattr(value, f.name), tensors) for f in dataclasses.fields(value)
        }
        return _Rebuild(type(value), fields)
    if isinstance(value, Mapping):
        items = {k: _strip(v, tensors) for k, v in value.items()}
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


def pack(value: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Returns (skeleton as a uint8 tensor, tensors in depth-first order).

    Raises:
        TypeError: a value that cannot cross stages (named by type).
    """
    tensors: list[torch.Tensor] = []
    skeleton = _strip(value, tensors)
    blob = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8), tensors


def unpack(skeleton: torch.Tensor, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`pack`."""
    structure = pickle.loads(skeleton.numpy().tobytes())
    return _fill(structure, tensors)


def slots(skeleton: torch.Tensor) -> list[TensorSlot]:
    """The tensor slots of a packed skeleton, in tensor order."""
    found: list[TensorSlot] = []

    def walk(node: Any) -> None:
        if isinstance(node, TensorSlot):
            found.append(node)
        elif isinstance(node, _Rebuild):
            for v in node.fields.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)

    walk(pickle.loads(skeleton.numpy().tobytes()))
    return sorted(found, key=lambda s: s.index)

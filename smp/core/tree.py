"""One walker for every value smp takes apart and rebuilds (design.md §4.7, guide §5).

smp walks user values in four places: a step's inputs (split into microbatches), its outputs
(detached, gathered into StepOutputs), the arguments and results of cross-stage calls (futures
resolved), and the arguments of tensor-parallel regions (gathered, scattered). They all go
through this module, which is torch's pytree (``torch.utils._pytree``: tuples, lists, dicts,
namedtuples, OrderedDict, defaultdict, deque, ``torch.Size``, ``torch.return_types``, and every
type registered on it — Hugging Face registers its ``ModelOutput`` classes) with smp's rules for
what pytree leaves whole:

1. a ``Mapping`` of another type (``transformers.BatchEncoding``, a user's dict subclass) is
   walked by its items and rebuilt as ``type(m)(**items)`` (or ``type(m)(items)``);
2. a list or tuple subclass is walked by its items and rebuilt as ``type(s)(items)``;
3. any other object is a leaf, unless the caller asks for ``objects=True``: then an object
   holding tensors (a Hugging Face cache, a dataclass) is rebuilt with its tensors replaced,
   through the same pickling that carries it across stages (``smp.core.messages``), i.e. a
   copy; an object pickle cannot carry stays a leaf.

The rules are smp-owned pytree node types registered once (:class:`_Items`, :class:`_Object`):
a value is first rewritten so that whatever rule 1-3 applies to is wrapped in one of them, so
:func:`flatten` / :func:`unflatten` are pytree's own and rebuild the original types. smp does not
register the types it does not own (a user's classes, Hugging Face caches) on torch's registry:
that registry is global, torch.export, FSDP and torch.compile read it, and a library that later
registers its own type would fail on the duplicate.

Example:
    leaves, spec = smp.core.tree.flatten({"ids": ids, "mask": batch_encoding})
    doubled = smp.core.tree.map_tensors(lambda t: t * 2, model_output)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from smp.core import messages

__all__ = ["flatten", "unflatten", "leaf_paths", "map_tensors", "tensors", "rebuild_mapping"]

PLAIN = messages.PLAIN  # values with nothing inside to walk


def rebuild_mapping(cls: type, items: dict) -> Mapping:
    """A mapping of type ``cls`` (dict, OrderedDict, ModelOutput-like) holding ``items``."""
    if cls is dict:
        return items
    try:
        return cls(**items)
    except TypeError:
        return cls(items)


@dataclasses.dataclass
class _Items:
    """Rule 1 or 2: a mapping, list or tuple of a type pytree does not know."""

    cls: type
    keys: tuple  # the mapping's keys, or () for a sequence
    values: list


@dataclasses.dataclass
class _Object:
    """Rule 3 (``objects=True``): an object holding tensors, as its pickled skeleton."""

    skeleton: Any  # smp.core.messages.Skeleton (comparable: specs are compared)
    modules: dict
    tensors: list


def _flatten_items(node: _Items):
    return node.values, (node.cls, node.keys)


def _unflatten_items(values, context):
    cls, keys = context
    values = list(values)
    if issubclass(cls, Mapping):
        return rebuild_mapping(cls, dict(zip(keys, values)))
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return cls(*values)
    return cls(values)


def _flatten_object(node: _Object):
    return node.tensors, (node.skeleton, node.modules)


def _unflatten_object(values, context):
    skeleton, modules = context
    return messages.fill(skeleton, list(values), modules)


def _items_with_keys(node: _Items):
    keys = node.keys or range(len(node.values))
    key = pytree.MappingKey if node.keys else pytree.SequenceKey
    return [(key(k), v) for k, v in zip(keys, node.values)], (node.cls, node.keys)


def _object_with_keys(node: _Object):
    return [(pytree.SequenceKey(i), t) for i, t in enumerate(node.tensors)], (
        node.skeleton,
        node.modules,
    )


pytree.register_pytree_node(
    _Items, _flatten_items, _unflatten_items, flatten_with_keys_fn=_items_with_keys
)
pytree.register_pytree_node(
    _Object, _flatten_object, _unflatten_object, flatten_with_keys_fn=_object_with_keys
)


def _known(value: Any) -> bool:
    return type(value) in pytree.SUPPORTED_NODES or pytree.is_namedtuple_instance(value)


def _leaves_at(is_leaf: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
    """pytree's ``is_leaf``: the caller's, and ``torch.Size`` (see PLAIN)."""
    if is_leaf is None:
        return lambda v: isinstance(v, torch.Size)
    return lambda v: isinstance(v, torch.Size) or is_leaf(v)


def _wrap_leaf(value: Any, objects: bool, is_leaf: Callable[[Any], bool] | None) -> Any:
    """A pytree leaf rewritten so that smp's rules apply to it (the leaf itself if none does)."""
    if isinstance(value, (torch.Tensor, *PLAIN)) or (is_leaf is not None and is_leaf(value)):
        return value
    if isinstance(value, Mapping):
        keys = tuple(value.keys())
        return _Items(type(value), keys, [_wrap(value[k], objects, is_leaf) for k in keys])
    if isinstance(value, (list, tuple)):
        return _Items(type(value), (), [_wrap(v, objects, is_leaf) for v in value])
    if objects:
        local: list = []
        try:
            skeleton, _, found = messages.pack_parts(value, local_modules=local)
        except TypeError:
            return value  # pickle cannot carry it: a leaf
        if found:
            modules = {f"#{i}": m for i, m in enumerate(local)}
            return _Object(skeleton, modules, found)
    return value


def _wrap(value: Any, objects: bool, is_leaf: Callable[[Any], bool] | None) -> Any:
    at = _leaves_at(is_leaf)
    if at(value) or not _known(value):
        return _wrap_leaf(value, objects, is_leaf)
    return pytree.tree_map(lambda v: _wrap_leaf(v, objects, is_leaf), value, is_leaf=at)


def _needs_rule(value: Any, objects: bool, is_leaf: Callable[[Any], bool] | None) -> bool:
    if isinstance(value, (torch.Tensor, *PLAIN)) or (is_leaf is not None and is_leaf(value)):
        return False
    return objects or isinstance(value, (Mapping, list, tuple))


def flatten(
    value: Any, *, objects: bool = False, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[Any], pytree.TreeSpec]:
    """``value``'s leaves (tensors and whatever no rule opens) and the spec that
    :func:`unflatten` rebuilds it from. ``is_leaf(v)`` true keeps ``v`` whole."""
    at = _leaves_at(is_leaf)
    leaves, spec = pytree.tree_flatten(value, is_leaf=at)
    if not any(_needs_rule(leaf, objects, is_leaf) for leaf in leaves):
        return leaves, spec  # pytree alone (the common case: one pass)
    return pytree.tree_flatten(_wrap(value, objects, is_leaf), is_leaf=at)


def unflatten(leaves: list[Any], spec: pytree.TreeSpec) -> Any:
    """The value :func:`flatten` took apart, with ``leaves`` in place of its leaves."""
    return pytree.tree_unflatten(leaves, spec)


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any, *, objects: bool = False) -> Any:
    """``value`` rebuilt with every tensor ``t`` replaced by ``fn(t)``; a value holding no
    tensor anywhere comes back as it is (not rebuilt)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    leaves, spec = flatten(value, objects=objects)
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return value
    return unflatten([fn(v) if isinstance(v, torch.Tensor) else v for v in leaves], spec)


def tensors(value: Any, *, objects: bool = False) -> list[torch.Tensor]:
    """Every tensor in ``value``, in :func:`flatten` order."""
    return [v for v in flatten(value, objects=objects)[0] if isinstance(v, torch.Tensor)]


def leaf_paths(value: Any, *, is_leaf: Callable[[Any], bool] | None = None) -> list[str]:
    """Where each of :func:`flatten`'s leaves is, as indexing text (``['ids'][0]``), for
    messages; ``[leaf i]`` where a type registered on pytree gives no keys."""
    at = _leaves_at(is_leaf)
    try:
        pairs, _ = pytree.tree_flatten_with_path(_wrap(value, False, is_leaf), is_leaf=at)
    except (ValueError, TypeError, NotImplementedError):
        return [f"[leaf {i}]" for i in range(len(flatten(value, is_leaf=is_leaf)[0]))]
    return [pytree.keystr(path) for path, _ in pairs]

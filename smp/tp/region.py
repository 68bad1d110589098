"""TP regions: smp's batch semantics at a distributed module's entry and exit, and the agreement
that keeps the ranks of a TP group in lockstep when their arguments differ.

A *TP region* is the forward of the outermost distributed module (a :class:`DistributedModule`,
or a Hugging Face block under a sharding plan). By default each rank of the TP group brings its
own samples: the region all-gathers the group's batch at entry, runs on it, and hands each rank
its own samples back at exit. The collectives inside are matched by order, so every rank must
pass arguments of the same structure and shapes. Real data does not promise that: Hugging Face
passes ``attention_mask=None`` for a batch without padding, and batches differ in length. The
ranks first agree on their arguments (smp.tp.agreement, Note [Region agreement]); where they
differ but can run, each rank's arguments run in turn.

Note [Runs in turn]
~~~~~~~~~~~~~~~~~~~
For j = 0 .. n-1, every rank receives TP rank j's arguments and runs the region on them as if
the group shared that batch (``prescaled_batch`` semantics); each rank keeps its own run's output.
All ranks run identical code on identical data, so the forward collectives match.
  - Entry: each tensor leaf of rank j travels as an all-reduce to which the other ranks add zeros
    of the described shape (``reduce_from_region``: exact, since x + 0 = x; the leaves of one
    dtype and requires_grad travel in one buffer). Its backward is the identity, as for
    ``gather_from_region``: gradients inside a region are the same on every rank, so rank j's copy
    holds the whole gradient. The other ranks' zeros require grad where rank j's leaf does, so
    every rank records the same graph.
  - Exit: each run's output passes ``copy_to_region`` (backward: an all-reduce of its gradient, to
    which only the run's owner adds a non-zero term), and the local :class:`_KeepRun` joins all
    runs into this rank's output, giving zeros to the other runs' in backward. So every rank's
    backward reaches every run, and as the runs' graphs are the same on every rank and the autograd
    engine runs ready nodes by decreasing sequence number, the backward collectives match too.
  - Objects: rank r's own run uses rank r's object. An object that holds no tensor travels with
    the descriptions (pickled), and rank j's run on every rank uses a copy of rank j's: exact
    whatever its contents. One that holds tensors (a key/value cache) cannot be sent: the other
    runs use a fork of rank r's own, taken before the first run (Python structure copied, tensors
    shared), so the object sees only this rank's samples, as its outputs do. This is exact when
    the region reads the same state from each rank's object, e.g. Hugging Face's cache in
    training (a fresh cache every forward, so the block's entry is empty).
The cost is n runs on one rank's samples each instead of one run on the group's batch: the same
FLOPs in smaller pieces, n times the region's collective calls, and all-reduces of every rank's
inputs (forward) and of the outputs' gradients (backward).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import logging
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from smp.core import tree
from smp.tp import functional as tpf
from smp.tp.agreement import (
    _VALUES,
    DivergentArgumentsError,
    _agree,
    _Call,
    _tensor_nodes,
    region_name,
)

__all__ = ["in_region", "batch_is_shared", "run_region", "region_name", "DivergentArgumentsError"]

logger = logging.getLogger("smp")


# ---- region state (per thread) -------------------------------------------------------------------

_region = threading.local()


def in_region() -> bool:
    """Whether this thread is inside a TP region (an outer distributed module's forward)."""
    return getattr(_region, "depth", 0) > 0


@contextlib.contextmanager
def _region_scope() -> Iterator[None]:
    _region.depth = getattr(_region, "depth", 0) + 1
    try:
        yield
    finally:
        _region.depth -= 1


@contextlib.contextmanager
def _shared_batch() -> Iterator[None]:
    """Inside, every rank of the TP group holds the same batch (a run of Note [Runs in turn])."""
    _region.shared = getattr(_region, "shared", 0) + 1
    try:
        yield
    finally:
        _region.shared -= 1


def batch_is_shared() -> bool:
    """Whether the ranks of a TP group hold the same batch: ``prescaled_batch``, or a region
    running one rank's arguments on the whole group (Note [Runs in turn])."""
    from smp.state import get_state, is_initialized

    if getattr(_region, "shared", 0) > 0:
        return True
    return is_initialized() and get_state().config.prescaled_batch


# ---- the region ---------------------------------------------------------------------------------


def run_region(
    module: nn.Module, fn: Callable, args: tuple, kwargs: dict, moves_batch: bool = True
) -> Any:
    """Runs ``fn(*args, **kwargs)`` as a TP region of ``module`` with smp's batch semantics.

    Nested inside another region, on a group of one rank, with ``prescaled_batch``, or when the
    primitives are local (``functional.local_only``): just runs it. Otherwise the TP group first
    agrees on the arguments (Note [Region agreement]). If they match on every rank, every tensor
    argument whose first dimension equals the batch size (that of the first tensor argument) is
    all-gathered along dim 0 (gather_from_region: its gradient comes back as this rank's chunk),
    ``fn`` runs on the group's batch, and every output tensor whose first dimension is the group's
    batch is cut back to this rank's samples (scatter_to_region). If they differ, ``fn`` runs
    once per rank's arguments (Note [Runs in turn]).

    Entry and exit read tensors' metadata (dtype, shape, device) and never their values, and the
    agreement travels on the host (Note [Agreement on the host]): on a GPU a region call never
    waits for the device.

    Args:
        module: the distributed module (``tp_group``, ``tp_size``, ``tp_rank``).
        moves_batch: False when ``fn`` moves the batch itself (it checks :func:`in_region` and
            :func:`batch_is_shared` as above and enters the region scope).

    Raises:
        DivergentArgumentsError: on every rank of the group, when the ranks' arguments differ in
            a way that cannot run (Note [Region agreement]).
    """
    if in_region() or module.tp_size == 1 or batch_is_shared() or tpf._local_only:
        return _call(fn, args, kwargs, moves_batch)
    mine = _Call.describe(module, args, kwargs)
    agreed = _agree(module, mine)
    if agreed is not None:
        specs, sent = agreed
        return _run_in_turn(module, fn, mine, specs, moves_batch, sent)
    if not moves_batch:
        return fn(*args, **kwargs)
    first = mine.tensors[0] if mine.tensors else None
    if first is None or first.dim() == 0:
        with _region_scope():
            return fn(*args, **kwargs)
    batch = first.size(0)
    group = module.tp_group

    def gather(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 1 and t.size(0) == batch:
            return tpf.gather_from_region(t, 0, group)
        return t

    def scatter(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 1 and t.size(0) == batch * module.tp_size:
            return tpf.scatter_to_region(t, 0, group)
        return t

    args, kwargs = tree.map_tensors(gather, (args, kwargs))
    with _region_scope():
        output = fn(*args, **kwargs)
    return tree.map_tensors(scatter, output)


def _call(fn: Callable, args: tuple, kwargs: dict, moves_batch: bool) -> Any:
    if not moves_batch:
        return fn(*args, **kwargs)
    with _region_scope():
        return fn(*args, **kwargs)


# ---- runs in turn -------------------------------------------------------------------------------


def _local_device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _receive(spec: tuple, mine: list[torch.Tensor] | None, group: Any) -> list[torch.Tensor]:
    """The tensor leaves of the call described by ``spec`` (this rank's own: ``mine``), on every
    rank: one all-reduce per (dtype, requires_grad, device type) to which the other ranks add
    zeros (Note [Runs in turn])."""
    nodes = list(_tensor_nodes(spec))
    grad = torch.is_grad_enabled()
    buckets: dict[tuple, list[int]] = {}
    for i, (_, dtype, _, requires_grad, device) in enumerate(nodes):
        buckets.setdefault((dtype, requires_grad and grad, device), []).append(i)
    received: list[torch.Tensor | None] = [None] * len(nodes)
    for (dtype, requires_grad, device), members in buckets.items():
        wire = torch.uint8 if dtype == torch.bool else dtype  # gloo has no bool
        sizes = [torch.Size(nodes[i][2]).numel() for i in members]
        if mine is not None:
            flat = torch.cat([mine[i].reshape(-1).to(wire) for i in members])
        else:
            flat = torch.zeros(
                sum(sizes), dtype=wire, device=_local_device(device), requires_grad=requires_grad
            )
        if flat.numel():
            flat = tpf.reduce_from_region(flat, group)
        for i, piece in zip(members, flat.split(sizes)):
            piece = piece.view(nodes[i][2])
            received[i] = piece.bool() if dtype == torch.bool else piece
    return received  # type: ignore[return-value]


def _rebuild(
    spec: tuple, tensors: list[torch.Tensor], objects: dict[tuple, Any]
) -> tuple[tuple, dict]:
    """The (args, kwargs) that ``spec`` describes, from its tensor leaves and this rank's objects
    (the check in :func:`_cannot_run` guarantees that each is there)."""
    leaves = iter(tensors)

    def build(node: tuple, path: tuple) -> Any:
        kind = node[0]
        if kind == "tensor":
            return next(leaves)
        if kind == "value":
            return node[1]
        if kind == "size":
            return torch.Size(node[1])
        if kind == "device":
            return _local_device(node[1])
        if kind == "list":
            return [build(c, (*path, i)) for i, c in enumerate(node[1])]
        if kind == "tuple":
            return tuple(build(c, (*path, i)) for i, c in enumerate(node[1]))
        if kind == "namedtuple":
            return objects[path](*(build(c, (*path, i)) for i, c in enumerate(node[2])))
        if kind == "dict":
            return {k: build(c, (*path, k)) for k, c in node[1]}
        if kind == "OrderedDict":
            return collections.OrderedDict((k, build(c, (*path, k))) for k, c in node[1])
        return objects[path]

    return build(spec[3], ("args",)), build(spec[4], ("kwargs",))


def _fork(objects: dict[tuple, Any]) -> dict[tuple, Any]:
    """Forks of this rank's objects for another rank's run: the Python structure (objects with a
    ``__dict__``, lists, dicts, sets, tuples) is copied, so changes that rebind (a key/value cache
    appending a step) stay in the fork; tensors, modules, classes and functions are shared."""
    memo: dict[int, Any] = {}
    shared = (torch.Tensor, nn.Module, type, types.FunctionType, types.MethodType)

    def fork(obj: Any) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        if isinstance(obj, shared) or type(obj) in _VALUES:
            return obj
        if type(obj) is list:
            new: Any = []
            memo[id(obj)] = new
            new.extend(fork(v) for v in obj)
        elif type(obj) in (dict, collections.OrderedDict):
            new = type(obj)()
            memo[id(obj)] = new
            new.update((k, fork(v)) for k, v in obj.items())
        elif type(obj) in (set, tuple):
            new = type(obj)(fork(v) for v in obj)
            memo[id(obj)] = new
        elif hasattr(obj, "__dict__"):
            new = copy.copy(obj)
            if new is obj:  # a singleton, or a class that does not copy: shared
                return obj
            memo[id(obj)] = new
            for key, value in vars(obj).items():
                vars(new)[key] = fork(value)
        else:
            return obj
        return new

    return {path: obj if isinstance(obj, type) else fork(obj) for path, obj in objects.items()}


class _KeepRun(torch.autograd.Function):
    """This rank's run's tensors, out of every run's (forward); zeros to the other runs'
    (backward). Joins every run to this rank's graph (Note [Runs in turn])."""

    @staticmethod
    def forward(ctx, run: int, counts: tuple[int, ...], *tensors: torch.Tensor):
        start = sum(counts[:run])
        ctx.own = (start, start + counts[run])
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(t.clone() for t in tensors[start : start + counts[run]])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        start, end = ctx.own
        out = [
            grads[i - start]
            if start <= i < end and grads[i - start] is not None
            else torch.zeros(shape, dtype=dtype, device=device)
            for i, (shape, dtype, device) in enumerate(ctx.meta)
        ]
        return (None, None, *out)


def _keep_own(outputs: list[Any], rank: int, group: Any) -> Any:
    """This rank's output of the runs, joined to every run for the backward (Note [Runs in
    turn]): each run's floating-point tensors travel in one buffer per (dtype, device)."""
    buffers: list[torch.Tensor] = []
    counts: list[int] = []
    layouts: list[list[tuple[list[int], list[torch.Size]]]] = []
    for out in outputs:
        leaves = [t for t in tree.tensors(out) if t.is_floating_point()]
        buckets: dict[tuple, list[int]] = {}
        for i, t in enumerate(leaves):
            buckets.setdefault((t.dtype, t.device), []).append(i)
        layout = []
        for members in buckets.values():
            parts = [leaves[i].reshape(-1) for i in members]
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)  # _KeepRun copies it
            buffers.append(tpf.copy_to_region(flat, group) if flat.requires_grad else flat)
            layout.append((members, [leaves[i].shape for i in members]))
        counts.append(len(layout))
        layouts.append(layout)
    if not any(b.requires_grad for b in buffers):
        return outputs[rank]
    kept = _KeepRun.apply(rank, tuple(counts), *buffers)
    replaced: dict[int, torch.Tensor] = {}
    for flat, (members, shapes) in zip(kept, layouts[rank]):
        pieces = flat.split([s.numel() for s in shapes])
        for i, piece, shape in zip(members, pieces, shapes):
            replaced[i] = piece.view(shape)
    position = itertools.count()

    def swap(t: torch.Tensor) -> torch.Tensor:
        return replaced[next(position)] if t.is_floating_point() else t

    return tree.map_tensors(swap, outputs[rank])


def _run_in_turn(
    module: nn.Module,
    fn: Callable,
    mine: _Call,
    specs: list[tuple],
    moves_batch: bool,
    sent: list[dict],
) -> Any:
    """Runs the region once per TP rank's arguments on every rank (Note [Runs in turn]): rank
    j's run uses rank j's sendable objects (a copy: ``sent[j]``), else this rank's own (its own
    run) or a fork of them."""
    group, rank = module.tp_group, module.tp_rank
    forks = [None if j == rank else {**_fork(mine.objects), **sent[j]} for j in range(len(specs))]
    outputs = []
    for j, spec in enumerate(specs):
        tensors = _receive(spec, mine.tensors if j == rank else None, group)
        args, kwargs = _rebuild(spec, tensors, mine.objects if j == rank else forks[j])
        with _shared_batch():
            outputs.append(_call(fn, args, kwargs, moves_batch))
    return _keep_own(outputs, rank, group)

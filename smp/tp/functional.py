"""Functional pieces of tensor parallelism: the region primitives, shard helpers, TP-aware dropout
and the vocab-parallel cross-entropy.

The six primitives are C++ autograd functions (``smp._C.tp``, see include/smp/pytorch/tp_comm.h);
this module resolves the group (default: smp's tensor-parallel group) and adds what Python does
better: bool tensors travel as uint8, and the shard/unshard arithmetic of parameters.

    function              forward                      backward
    copy_to_region        identity                     all-reduce SUM
    reduce_from_region    all-reduce SUM               identity
    scatter_to_region     keep own chunk along dim     all-gather along dim
    gather_from_region    all-gather along dim         keep own chunk along dim
    reduce_scatter        reduce-scatter SUM on dim    all-gather along dim
    all_gather            all-gather along dim         reduce-scatter SUM on dim
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from smp import _C, kernels
from smp.comm import collective
from smp.core.rng import random_streams, set_random_streams, tp_rng
from smp.core.shards import gather_shards, shard_state, shard_tensor, unshard_tensor

__all__ = [
    "tp_group",
    "copy_to_region",
    "reduce_from_region",
    "scatter_to_region",
    "gather_from_region",
    "reduce_scatter",
    "all_gather",
    "shard_tensor",
    "unshard_tensor",
    "gather_shards",
    "shard_state",
    "tp_dropout",
    "tp_rng",
    "random_streams",
    "set_random_streams",
    "vocab_parallel_cross_entropy",
    "local_only",
    "observing",
]


_local_only = 0
_stand_in: Any = None  # local_only's group, for tp_group(None)
# Called as (primitive, bytes of the whole buffer it moves) by each primitive run under
# ``local_only``: the planner prices the collectives a forward would issue (``observing``).
_observers: list[Callable[[str, int], None]] = []


@contextlib.contextmanager
def observing(callback: Callable[[str, int], None]) -> Iterator[None]:
    """Inside (and inside ``local_only``), each primitive calls ``callback(name, nbytes)``:
    its name ("copy_to_region", "reduce_from_region", "scatter_to_region",
    "gather_from_region", "reduce_scatter", "all_gather") and the bytes of the whole buffer its
    collective moves (the all-reduced tensor; a gather's or scatter's whole tensor)."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def _note(name: str, whole: torch.Tensor) -> None:
    for callback in _observers:
        callback(name, whole.numel() * whole.element_size())


@contextlib.contextmanager
def local_only(group: Any = None) -> Iterator[None]:
    """Inside, no primitive communicates: each one returns a tensor of the shape it would
    return with the whole group (a gather repeats this rank's part ``size`` times, a scatter
    or reduce-scatter keeps this rank's chunk, a reduction keeps this rank's value), so every
    distributed module computes on the shapes, and costs, it has in training; the values are
    not the group's. Used when one rank runs the model alone: the partitioner's tracing pass on
    rank 0, and the planner's profile of a layout before smp runs (``group``: an object with
    ``size()`` and ``rank()`` that ``tp_group(None)`` returns inside, standing in for a TP group
    no process holds). (Turning each primitive into the identity instead broke modules that
    enter the region from a whole tensor: a hidden-split LayerNorm or a row-split Linear then
    saw the full width against its shard.)"""
    global _local_only, _stand_in
    _local_only += 1
    outer = _stand_in
    if group is not None:
        _stand_in = group
    try:
        yield
    finally:
        _local_only -= 1
        _stand_in = outer


def _local_chunk(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``local_only``: this rank's chunk of ``x`` along ``dim``, as a scatter would give it."""
    g = tp_group(group)
    if g.size() == 1:
        return x
    # chunk()'s piece, without making the other g.size() - 1 views
    step = -(-x.shape[dim] // g.size())
    start = min(step * g.rank(), x.shape[dim])
    return x.narrow(dim, start, min(step, x.shape[dim] - start))


def _local_repeat(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``local_only``: ``x`` repeated along ``dim`` to the shape a gather would give."""
    g = tp_group(group)
    if g.size() == 1:
        return x
    times = [1] * x.dim()
    times[dim] = g.size()
    return x.repeat(times)  # torch.cat([x] * size, dim), one op however large the group


def tp_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """``group``, or smp's tensor-parallel group when None (needs ``smp.init``)."""
    if group is not None:
        return group
    if _stand_in is not None:
        return _stand_in
    from smp.state import get_state

    return get_state().groups["tp"]


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Identity forward; all-reduce (SUM) of the gradient backward."""
    if _local_only:
        _note("copy_to_region", x)
        return x
    return _C.tp.copy_to_region(x, tp_group(group))


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce (SUM) forward; identity backward."""
    if _local_only:
        _note("reduce_from_region", x)
        return x
    return _C.tp.reduce_from_region(x, tp_group(group))


def scatter_to_region(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's chunk along ``dim`` forward; all-gather of the gradient backward."""
    if _local_only:
        _note("scatter_to_region", x)
        return _local_chunk(x, dim, group)
    return _C.tp.scatter_to_region(x, dim, tp_group(group))


def gather_from_region(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather along ``dim`` forward; this rank's chunk of the gradient backward.

    Works for any dtype: bool tensors are sent as uint8 (gloo has no bool)."""
    if _local_only:
        out = _local_repeat(x, dim, group)
        _note("gather_from_region", out)
        return out
    if x.dtype == torch.bool:
        return _C.tp.gather_from_region(x.to(torch.uint8), dim, tp_group(group)).bool()
    return _C.tp.gather_from_region(x, dim, tp_group(group))


def reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None):
    """Reduce-scatter (SUM) along ``dim`` forward; all-gather of the gradient backward."""
    if _local_only:
        _note("reduce_scatter", x)
        return _local_chunk(x, dim, group)
    return _C.tp.reduce_scatter(x, dim, tp_group(group))


def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None):
    """All-gather along ``dim`` forward; reduce-scatter (SUM) of the gradient backward."""
    if _local_only:
        out = _local_repeat(x, dim, group)
        _note("all_gather", out)
        return out
    return _C.tp.all_gather(x, dim, tp_group(group))


def tp_dropout(x: torch.Tensor, p: float, training: bool, kind: str) -> torch.Tensor:
    """Inverted dropout drawing its mask from the TP-aware generator ``kind``.

    "replicated" must be used on tensors every TP rank holds whole (all draw the same mask);
    "sharded" on tensors split across the group or holding different samples."""
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return torch.zeros_like(x)
    keep = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    keep.bernoulli_(1.0 - p, generator=tp_rng(kind, x.device))
    return x * keep / (1.0 - p)


# ---- vocab-parallel cross-entropy ---------------------------------------------------------------


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross-entropy of logits split over the vocabulary, never gathering them.

    Args:
        logits: [..., V/n], this rank's vocabulary slice (columns ``vocab_start`` onwards), every
            rank holding the same tokens.
        target: [...] global token ids; ``ignore_index`` tokens get a loss of 0.
        vocab_start: the first vocabulary id of this rank's slice.

    Returns:
        [...] the loss of each token, equal to ``F.cross_entropy(full_logits, target,
        reduction="none")``, in float32. Communication: one all-gather of each rank's
        [3, tokens] float32 statistics (row max, sum of exp, target logit); none backward.

    With the fused kernel on (the default, :func:`smp.kernels.set_fused`) the statistics and
    the gradient each take one pass over the logits (smp/kernels.py) and nothing of size
    [tokens, V/n] is kept for backward beyond the logits themselves; off, the ATen composition
    below runs instead (three all-reduces, float32 intermediates kept by autograd).
    """
    group = tp_group(group)
    if kernels.fused_enabled("cross_entropy"):
        gather = None
        if group.size() > 1 and not _local_only:

            def gather(stats: torch.Tensor) -> torch.Tensor:
                everyone = stats.new_empty((group.size() * stats.size(0), *stats.shape[1:]))
                with collective("tensor-parallel all-gather (cross-entropy statistics)"):
                    dist.all_gather_into_tensor(everyone, stats, group=group)
                return everyone.view(group.size(), *stats.shape)

        return kernels.vocab_cross_entropy(logits, target, vocab_start, ignore_index, gather)
    return _composed_cross_entropy(logits, target, vocab_start, group, ignore_index)


def _composed_cross_entropy(logits, target, vocab_start, group, ignore_index):
    """The vocab-parallel cross-entropy as an ATen composition under autograd: one all-reduce
    MAX (no gradient), then two SUM all-reduces (the softmax normaliser, the target logit)."""
    local_vocab = logits.size(-1)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    with torch.no_grad():
        global_max = logits.max(dim=-1).values
        if group.size() > 1 and not _local_only:
            with collective("tensor-parallel all-reduce MAX"):
                dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - global_max.unsqueeze(-1)
    sum_exp = reduce_from_region(shifted.exp().sum(dim=-1), group)
    local_target = target - vocab_start
    in_slice = (local_target >= 0) & (local_target < local_vocab)
    index = torch.where(in_slice, local_target, torch.zeros_like(local_target))
    picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_region(
        torch.where(in_slice, picked, torch.zeros_like(picked)), group
    )
    loss = torch.log(sum_exp) - target_logit
    return torch.where(target == ignore_index, torch.zeros_like(loss), loss)

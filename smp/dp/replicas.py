"""Data-parallel replicas that start and stay equal.

At wrap time every replica must have built the same model (names, shapes, dtypes), and its
parameters and buffers are broadcast from one replica to the others; buffers again at each
step (``broadcast_buffers``), and the whole model after ``DistributedModel.join()``. A tensor
split over the tensor-parallel group differs across that group: it is broadcast over its rdp
group, everything else over the dp group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp.state import get_state

__all__ = ["broadcast", "broadcast_model", "check_replicas_match", "is_tp_shard"]


def is_tp_shard(p: torch.Tensor) -> bool:
    """Whether ``p`` is this rank's shard of a tensor split over the TP group."""
    return getattr(p, "_smp_tp_split", None) is not None


def broadcast(tensors: list[torch.Tensor], group: str, root: int, bucket_bytes: int) -> None:
    """Broadcasts ``tensors`` from rank ``root`` (an index in the group) of this rank's group
    ``group``, in buckets of ``bucket_bytes``."""
    state = get_state()
    if state.axis_size(group) == 1 or not tensors:
        return
    with torch.no_grad():
        # The root is a rank of the group, as in c10d's BroadcastOptions.
        dist._broadcast_coalesced(state.groups[group], tensors, bucket_bytes, root)


def broadcast_model(
    module: nn.Module, root: Callable[[str], int | None], bucket_bytes: int
) -> None:
    """Parameters and buffers from one replica to the others: TP shards differ across the
    TP group, so each is broadcast over its rdp group; everything else (replicated
    parameters included) is the same on every rank of the dp group. ``root(group)`` is the
    index in the group to broadcast from (None: nothing). Tensors another stage holds
    (released, empty) are left out."""
    params = list(module.parameters())  # each once, even if shared
    for group, tensors in (
        ("dp", [p for p in params if not is_tp_shard(p)] + list(module.buffers())),
        ("rdp", [p for p in params if is_tp_shard(p)]),
    ):
        index = root(group)
        if index is not None:
            broadcast([t for t in tensors if t.numel() > 0], group, index, bucket_bytes)


def check_replicas_match(module: nn.Module) -> None:
    """Fails on every rank if dp replicas differ in parameter/buffer names, shapes or dtypes."""
    state = get_state()
    if state.axis_size("dp") == 1:
        return
    layout = [
        (name, tuple(t.shape), str(t.dtype))
        for name, t in (*module.named_parameters(), *module.named_buffers())
    ]
    digest = hashlib.sha256(repr(layout).encode()).hexdigest()
    if len(set(_gathered(digest, "dp"))) == 1:
        return
    layouts = _gathered(layout, "dp")
    ranks = state.group_ranks["dp"]
    base = layouts[0]
    for other_rank, other in zip(ranks[1:], layouts[1:]):
        if other != base:
            diff = next(
                ((a, b) for a, b in zip(base, other) if a != b),
                (f"{len(base)} tensors", f"{len(other)} tensors"),
            )
            raise ValueError(
                "smp.DistributedModel: the model differs between data-parallel replicas: rank "
                f"{ranks[0]} has {diff[0]} where rank {other_rank} has {diff[1]}; build the same "
                "model on every rank"
            )


def _gathered(value: Any, group: str) -> list[Any]:
    """``value`` of every rank of this rank's group ``group``, in group order."""
    state = get_state()
    values: list[Any] = [None] * state.axis_size(group)
    dist.all_gather_object(values, value, group=state.groups[group])
    return values

"""A wrapped model's delayed parameters get their values (design.md §7.4).

``smp.delay_param_initialization`` leaves each parameter a size-0 placeholder with a record of
its initialisation (:mod:`smp.memory.delayed`). Once a rank knows what it holds, it replays the
records of those parameters, one at a time:

- :func:`owned`: after the partition (or at wrap time with one stage), the parameters this rank
  owns. The replicas of a stage seeded alike replay equal values, which :func:`replicas_agree`
  checks with one CRC-32C per rank instead of broadcasting them.
- :class:`BlockReplay`: with sharded data parallelism, block by block, each block's values
  replayed just before it is sharded, so that no rank holds more than one block whole. Nothing
  is broadcast there: every rank keeps its chunk of its own replay, so :meth:`BlockReplay.finish`
  fails on every rank if the replays differ.

Storages freed on the way go to a pool ({(numel, dtype): [flat tensors]}) the next replays
reuse: a process that frees and allocates large tensors one after another does not get its
freed memory back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp import _C
from smp.memory import delayed
from smp.state import get_state

__all__ = ["BlockReplay", "owned", "replicas_agree", "while_tracing"]


def while_tracing(module: nn.Module, pool: dict, enabled: bool):
    """While tracing runs, each module's delayed parameters hold values during its forward
    only (nothing to do where ``enabled`` is False: no parameter is delayed)."""
    if not enabled:
        return contextlib.nullcontext()
    return delayed.materialized_while_called(module, pool)


def owned(module: nn.Module, owns: Callable[[str], bool], pool: dict) -> set[int]:
    """Gives the delayed parameters of ``module`` whose names ``owns`` accepts the values eager
    construction would have given them, one at a time, reusing the storages of ``pool`` (empty
    afterwards). Returns the ids of the parameters given values."""
    seen: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen or not delayed.waiting(p) or not owns(name):
            continue
        seen.add(id(p))
        delayed.materialize(p, pool)
    pool.clear()
    return seen


class BlockReplay:
    """Called with each block just before it is sharded: gives the block's delayed parameters
    their values (those not sharded yet), adding them to this rank's CRC-32C of replayed
    values. The whole values of the block sharded before it (each rank keeps its chunks) are
    replayed into again."""

    def __init__(self, pool: dict):
        self.pool = pool
        self.crc = 0
        self._unsharded: list[torch.Tensor] = []

    def __call__(self, block: nn.Module) -> None:
        delayed.recycle(self._unsharded, self.pool)
        self._unsharded = []
        for p in block.parameters():
            if delayed.waiting(p):
                delayed.materialize(p, self.pool)
                self.crc = _crc32c(p, self.crc)
                self._unsharded.append(p.detach())

    def finish(self) -> None:
        """Frees what the replays kept, then fails on every rank if the replayed parameters
        differ between the ranks that shard them (each keeps its chunk of its own replay, so
        they must have replayed alike)."""
        self._unsharded = []
        self.pool.clear()
        state = get_state()
        crcs = _gathered(self.crc, "rdp")
        if len(set(crcs)) > 1:
            raise ValueError(
                "smp.DistributedModel: with delayed_parameter_initialization and "
                "sharded_data_parallel_degree > 1 every rank must build the model from the same "
                "seed (each rank keeps its chunk of its own replay, nothing is broadcast); the "
                f"replayed values differ between ranks {state.group_ranks['rdp']} (CRC-32C "
                f"{crcs}): call torch.manual_seed(same value) on every rank before building it"
            )


def replicas_agree(module: nn.Module, group: str) -> bool:
    """Whether every rank of ``group`` ("dp": parameters, "rdp": TP shards) holds the same
    values (one CRC-32C of this rank's, all-gathered): replayed delayed parameters agree
    when every rank seeded alike, and then need no broadcast (whose buckets cost memory
    right when the stage's parameters have just been allocated)."""
    state = get_state()
    if state.axis_size(group) == 1:
        return True
    crc = 0
    for p in module.parameters():  # each once, even if shared
        is_shard = getattr(p, "_smp_tp_split", None) is not None
        if p.numel() > 0 and is_shard == (group == "rdp"):
            crc = _crc32c(p, crc)
    return len(set(_gathered(crc, group))) == 1


def _crc32c(t: torch.Tensor, crc: int) -> int:
    """``crc`` extended by the bytes of ``t``'s values."""
    data = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return _C.crc32c(memoryview(data), crc)


def _gathered(value: Any, group: str) -> list[Any]:
    """``value`` of every rank of this rank's group ``group``, in group order."""
    state = get_state()
    values: list[Any] = [None] * state.axis_size(group)
    dist.all_gather_object(values, value, group=state.groups[group])
    return values

"""The optimizer state's layout across ranks, for ``smp.DistributedOptimizer``.

With ``shard_optimizer_state`` (ZeRO-1) every parameter of a stage belongs to one rank of the
group holding the same parameters (rdp, :func:`balance_owners`): only its owner keeps its
optimizer state and updates it (:func:`step_owned`), then broadcasts the new values to the
group. A partial state dict holds the owner's entries, with their indices under ``SHARD_KEY``
(:func:`check_partial` checks them on a load).

The full state dict is the state one process training the whole model would hold:
:func:`gather_full` joins every rank's part into it (sharded data parallelism's chunks,
tensor-parallel shards, the owners' entries, the pipeline stages) and :func:`take_local` cuts
this rank's part from it. The functions take the optimizer (a torch optimizer) and what they
need of its model as arguments.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from smp.core.shards import gather_shards, shard_tensor
from smp.dp import sharded
from smp.state import get_state

__all__ = [
    "balance_owners",
    "check_partial",
    "gather_full",
    "only",
    "owned_indices",
    "owners",
    "parameters",
    "step_owned",
    "take_local",
]

_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def balance_owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """The owner (0 .. ranks - 1) of each item of ``sizes``: largest item first (ties: the lower
    index first), each to the least loaded rank so far (ties: the lower rank). Deterministic, so
    every rank computing it from the same sizes gets the same answer. The largest load is at
    most the ideal share ``sum / ranks`` plus one item."""
    if ranks < 1:
        raise ValueError(f"balance_owners: ranks must be >= 1, got {ranks}")
    owners = [0] * len(sizes)
    loads = [(0, rank) for rank in range(ranks)]  # a heap of (load, rank)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + sizes[index], rank))
    return owners


def parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in group order (a state dict's indices)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def owners(optimizer: torch.optim.Optimizer) -> list[int | None] | None:
    """With ``shard_optimizer_state`` over more than one rdp rank: the rdp rank that owns
    each optimizer parameter (by its index in the groups; None for a parameter another
    pipeline stage holds), else None. Computed from the parameters' sizes alone, the same
    on every rank of the rdp group and of the TP group (a TP shard has the same size on
    every TP rank); recomputed when the live parameters change (a partition releases
    those of other stages)."""
    state = get_state()
    if not state.config.shard_optimizer_state or state.axis_size("rdp") == 1:
        return None
    params = parameters(optimizer)
    key = tuple(p.numel() for p in params)
    cached = getattr(optimizer, "_smp_shard", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    live = [i for i, n in enumerate(key) if n > 0]
    picks = balance_owners([key[i] for i in live], state.axis_size("rdp"))
    found: list[int | None] = [None] * len(params)
    for index, rank in zip(live, picks):
        found[index] = rank
    optimizer._smp_shard = (key, found)
    return found


def owned_indices(owners: list[int | None]) -> list[int]:
    """The indices of the parameters this rdp rank owns."""
    rank = get_state().axis_rank("rdp")
    return [i for i, owner in enumerate(owners) if owner == rank]


def only(entries: dict, indices) -> dict:
    """The state entries of the parameters at ``indices``."""
    indices = set(indices)
    return {i: e for i, e in entries.items() if int(i) in indices}


# ---- the owners' step -----------------------------------------------------------------------


def step_owned(
    optimizer: torch.optim.Optimizer,
    owners: list[int | None],
    algorithm_step: Callable[[], Any],
    closure: Callable[[], Any] | None,
    bucket_bytes: int | None,
):
    """``algorithm_step`` (the optimizer class's own step) on the parameters this rank owns
    (the others' gradients are hidden: torch optimizers skip a parameter without one and
    create no state for it), then every owner's new values broadcast over the rdp group in
    flat buffers of at most ``bucket_bytes``. Returns the closure's loss."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    _drop_unowned_state(optimizer, owners)
    owned = set(owned_indices(owners))
    hidden = []
    for index, p in enumerate(parameters(optimizer)):
        if index not in owned and p.grad is not None:
            hidden.append((p, p.grad))
            p.grad = None
    try:
        algorithm_step()
    finally:
        for p, grad in hidden:
            p.grad = grad
    _broadcast_owned(parameters(optimizer), owners, bucket_bytes or _DEFAULT_BUCKET_BYTES)
    return loss


def _drop_unowned_state(optimizer: torch.optim.Optimizer, owners: list[int | None]) -> None:
    """Frees the state of every parameter this rank does not own (e.g. a full state loaded
    before the partition decided the owners)."""
    owned = set(owned_indices(owners))
    for index, p in enumerate(parameters(optimizer)):
        if index not in owned:
            optimizer.state.pop(p, None)


def _broadcast_owned(params: list[torch.Tensor], owners: list[int | None], cap: int) -> None:
    """Every owner's trainable parameters to the rest of the rdp group: per owner (in rdp
    order) and per dtype, flat buffers of at most ``cap`` bytes (the model's
    ``bucket_cap_mb``); every rank issues the same broadcasts in the same order."""
    state = get_state()
    group = state.groups["rdp"]
    me = state.axis_rank("rdp")
    with torch.no_grad():
        for owner in range(state.axis_size("rdp")):
            src = state.world_rank_of("rdp", owner)
            kinds: dict[tuple, list[torch.Tensor]] = {}
            for index, p in enumerate(params):
                if owners[index] == owner and p.requires_grad:
                    kinds.setdefault((p.dtype, p.device), []).append(p.detach())
            for tensors in kinds.values():
                for bucket in _buckets(tensors, cap):
                    if owner == me:
                        flat = _flatten_dense_tensors(bucket)
                    else:
                        size = sum(t.numel() for t in bucket)
                        flat = torch.empty(size, dtype=bucket[0].dtype, device=bucket[0].device)
                    dist.broadcast(flat, src=src, group=group)
                    if owner != me:
                        for t, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                            t.copy_(value)


def _buckets(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut into runs of at most ``cap`` bytes (a larger tensor alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


# ---- state dicts ----------------------------------------------------------------------------


def check_partial(saved: list[int] | None, owners: list[int | None] | None) -> None:
    """Raises ValueError unless a partial state's ``SHARD_KEY`` indices (``saved``; None
    without sharding) are those this rank owns under ``owners``."""
    mine = None if owners is None else owned_indices(owners)
    if saved is not None:
        saved = [int(i) for i in saved]
    if saved != mine:
        state = get_state()
        raise ValueError(
            "optimizer.load_state_dict: this partial state (local_state_dict) holds the "
            f"optimizer state of parameters {_brief(saved)}, but this rank (rdp rank "
            f"{state.axis_rank('rdp')} of {state.axis_size('rdp')}, shard_optimizer_state="
            f"{state.config.shard_optimizer_state}) keeps {_brief(mine)}: a partial state "
            "loads on the layout that saved it; save state_dict() (full) to load on another"
        )


def _brief(indices: list[int] | None) -> str:
    if indices is None:
        return "all (no sharding)"
    shown = ", ".join(str(i) for i in indices[:6])
    return f"[{shown}{', ...' if len(indices) > 6 else ''}] ({len(indices)})"


def gather_full(entries: dict, params: list[torch.Tensor], owners: list[int | None] | None):
    """This rank's packed state ``entries`` joined with every other rank's into the full
    state's, sorted by index: sharded data parallelism's chunks and tensor-parallel shards to
    full shapes, the owners' entries over the rdp group (each rank's own only, float32 master
    weights too), the pipeline stages' entries. A collective over those groups."""
    state = get_state()
    if owners is not None:  # each rank's own entries; masters from their owners too
        entries = only(entries, owned_indices(owners))
    if sharded.enabled():  # whole tensors (collectives in index and key order)
        entries = {
            i: {k: sharded.full(v) for k, v in sorted(entries[i].items())} for i in sorted(entries)
        }
    entries = _unshard(entries, params, state)
    if owners is not None:
        entries = {i: {k: _cpu(v) for k, v in e.items()} for i, e in entries.items()}
        parts: list[Any] = [None] * state.axis_size("rdp")
        dist.all_gather_object(parts, entries, group=state.groups["rdp"])
        entries = {i: e for part in parts for i, e in part.items()}
    if state.axis_size("pp") > 1:
        entries = {i: {k: _cpu(v) for k, v in e.items()} for i, e in entries.items()}
        stages: list[Any] = [None] * state.axis_size("pp")
        dist.all_gather_object(stages, entries, group=state.groups["pp"])
        entries = {i: e for part in stages for i, e in part.items()}
    return dict(sorted(entries.items()))


def take_local(entries: dict, params: list[torch.Tensor]) -> dict:
    """This rank's part of a full state's ``entries``: its stage's parameters (the live ones),
    its tensor-parallel shards, and under sharded data parallelism its chunk of each sharded
    parameter's state. All of its stage's entries, owned or not (the caller keeps the owned)."""
    state = get_state()
    live = {i for i, p in enumerate(params) if p.numel() > 0}
    entries = {i: e for i, e in entries.items() if int(i) in live}
    entries = _shard(entries, params, state)
    if sharded.enabled():  # this rank's chunk of each sharded parameter's state
        entries = {
            i: {k: sharded.like(v, params[int(i)]) for k, v in e.items()}
            for i, e in entries.items()
        }
    return entries


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _split_of(param: torch.Tensor) -> tuple[int, int] | None:
    return getattr(param, "_smp_tp_split", None)


def _unshard(entries: dict, params: list, state) -> dict:
    """Optimizer state with each tensor shaped like a TP-split parameter's shard joined to the
    full shape (an all-gather over the TP group per tensor, in index order on every TP rank)."""
    if state.axis_size("tp") == 1:
        return entries
    group = state.groups["tp"]
    out = {}
    for index in sorted(entries):
        entry, param = dict(entries[index]), params[index]
        split = _split_of(param)
        for key, value in sorted(entry.items()):
            if split is not None and isinstance(value, torch.Tensor) and value.shape == param.shape:
                entry[key] = gather_shards(value, *split, group)
        out[index] = entry
    return out


def _shard(entries: dict, params: list, state) -> dict:
    """The inverse of :func:`_unshard` for this TP rank: full-shape tensors of split
    parameters cut to this rank's shard."""
    if state.axis_size("tp") == 1:
        return entries
    n, r = state.axis_size("tp"), state.axis_rank("tp")
    out = {}
    for index, entry in entries.items():
        param, entry = params[int(index)], dict(entry)
        split = _split_of(param)
        for key, value in entry.items():
            if split is None or not isinstance(value, torch.Tensor) or value.dim() <= split[0]:
                continue
            if value.size(split[0]) == param.size(split[0]) * n:
                entry[key] = shard_tensor(value, split[0], split[1], n, r)
        out[index] = entry
    return out

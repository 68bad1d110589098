"""The layout of a tensor split over ranks: a tensor-parallel parameter's shard of the full
tensor (``_smp_tp_split`` = (dim, fused blocks)), and back. Pure arithmetic, plus one
all-gather in :func:`gather_shards`; used by tensor parallelism, delayed initialisation, state
dicts, the optimizer and checkpoints."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["shard_tensor", "unshard_tensor", "gather_shards", "shard_state"]


def shard_tensor(full: torch.Tensor, dim: int, fused: int, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` split ``size`` ways along ``dim``.

    ``fused`` > 1 means ``full`` is ``fused`` equal blocks along ``dim`` (e.g. a fused QKV weight
    is 3 blocks): each block is split on its own and the rank's pieces are concatenated, so the
    shard holds rank's part of Q, then of K, then of V.
    """
    blocks = full.chunk(fused, dim) if fused > 1 else (full,)
    return torch.cat([b.chunk(size, dim)[rank] for b in blocks], dim).contiguous()


def unshard_tensor(shards: Sequence[torch.Tensor], dim: int, fused: int) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: the full tensor from every rank's shard, in rank order."""
    if fused == 1:
        return torch.cat(list(shards), dim)
    per_rank = [s.chunk(fused, dim) for s in shards]
    return torch.cat([torch.cat([p[j] for p in per_rank], dim) for j in range(fused)], dim)


def gather_shards(shard: torch.Tensor, dim: int, fused: int, group: dist.ProcessGroup):
    """The full tensor of which every rank of ``group`` holds ``shard`` (an all-gather, then
    :func:`unshard_tensor`); a collective: every rank of the group calls it, in one order."""
    shard = shard.detach().contiguous()
    parts = [torch.empty_like(shard) for _ in range(group.size())]
    dist.all_gather(parts, shard, group=group)
    return unshard_tensor(parts, dim, fused)


def shard_state(
    full: dict[str, torch.Tensor], params: dict[str, torch.Tensor], size: int, rank: int
) -> dict[str, torch.Tensor]:
    """A full-shape state dict with each entry whose parameter in ``params`` (same keys) is split
    (``_smp_tp_split``) replaced by rank ``rank``'s shard; other entries are kept as they are."""
    out = dict(full)
    for key, value in full.items():
        split = getattr(params.get(key), "_smp_tp_split", None)
        if split is not None:
            out[key] = shard_tensor(value, split[0], split[1], size, rank)
    return out

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
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from smp import _C, kernels
from smp.comm import collective

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
]


_local_only = 0


@contextlib.contextmanager
def local_only() -> Iterator[None]:
    """Inside, no primitive communicates: each one returns a tensor of the shape it would
    return with the whole group (a gather repeats this rank's part ``size`` times, a scatter
    or reduce-scatter keeps this rank's chunk, a reduction keeps this rank's value), so every
    distributed module computes on the shapes, and costs, it has in training; the values are
    not the group's. Used when one rank runs the model alone: the partitioner's tracing pass on
    rank 0. (Turning each primitive into the identity instead broke modules that enter the
    region from a whole tensor: a hidden-split LayerNorm or a row-split Linear then saw the
    full width against its shard.)"""
    global _local_only
    _local_only += 1
    try:
        yield
    finally:
        _local_only -= 1


def _local_chunk(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``local_only``: this rank's chunk of ``x`` along ``dim``, as a scatter would give it."""
    g = tp_group(group)
    return x.chunk(g.size(), dim)[g.rank()] if g.size() > 1 else x


def _local_repeat(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``local_only``: ``x`` repeated along ``dim`` to the shape a gather would give."""
    g = tp_group(group)
    return torch.cat([x] * g.size(), dim) if g.size() > 1 else x


def tp_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """``group``, or smp's tensor-parallel group when None (needs ``smp.init``)."""
    if group is not None:
        return group
    from smp.state import get_state

    return get_state().groups["tp"]


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Identity forward; all-reduce (SUM) of the gradient backward."""
    if _local_only:
        return x
    return _C.tp.copy_to_region(x, tp_group(group))


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce (SUM) forward; identity backward."""
    if _local_only:
        return x
    return _C.tp.reduce_from_region(x, tp_group(group))


def scatter_to_region(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's chunk along ``dim`` forward; all-gather of the gradient backward."""
    if _local_only:
        return _local_chunk(x, dim, group)
    return _C.tp.scatter_to_region(x, dim, tp_group(group))


def gather_from_region(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather along ``dim`` forward; this rank's chunk of the gradient backward.

    Works for any dtype: bool tensors are sent as uint8 (gloo has no bool)."""
    if _local_only:
        return _local_repeat(x, dim, group)
    if x.dtype == torch.bool:
        return _C.tp.gather_from_region(x.to(torch.uint8), dim, tp_group(group)).bool()
    return _C.tp.gather_from_region(x, dim, tp_group(group))


def reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None):
    """Reduce-scatter (SUM) along ``dim`` forward; all-gather of the gradient backward."""
    if _local_only:
        return _local_chunk(x, dim, group)
    return _C.tp.reduce_scatter(x, dim, tp_group(group))


def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None):
    """All-gather along ``dim`` forward; reduce-scatter (SUM) of the gradient backward."""
    if _local_only:
        return _local_repeat(x, dim, group)
    return _C.tp.all_gather(x, dim, tp_group(group))


# ---- parameter shards ---------------------------------------------------------------------------


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


# ---- randomness ---------------------------------------------------------------------------------


def tp_rng(kind: str, device: torch.device | str | None = None) -> torch.Generator:
    """The TP-aware generator ``kind`` of this rank, on ``device`` (default: the CPU).

    "replicated": the same stream on every rank of a TP group, for dropout on tensors every rank
    holds whole (so the masks agree). "sharded": a different stream on every TP rank, for
    tensors split across the group or holding different samples. Both derive from
    ``tensor_parallel_seed``, the pipeline stage and the rdp rank, and restart at every
    ``smp.init``, so runs are reproducible. Each device has its own generator of each kind,
    seeded alike, so a CUDA tensor's mask is drawn on its GPU (no host mask, no copy) and still
    agrees across the group where it must.
    """
    from smp.state import get_state, is_initialized

    if not is_initialized():
        raise RuntimeError("smp.nn dropout needs smp.init(...) first (it seeds the TP generators)")
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    state = get_state()
    generators = getattr(state, "tp_generators", None)
    if generators is None:
        generators = state.tp_generators = {}
    key = kind if device.type == "cpu" else f"{kind}@{device}"
    if key not in generators:
        if kind not in ("replicated", "sharded"):
            raise ValueError(f'TP generator kind must be "replicated" or "sharded", got {kind!r}')
        base = (
            state.config.tensor_parallel_seed * 1_000_003
            + state.axis_rank("pp") * 7919
            + state.axis_rank("rdp") * 104_729
        )
        if kind == "sharded":
            base += 2718 + 31 * (state.axis_rank("tp") + 1)
        generators[key] = torch.Generator(device=device).manual_seed(base)
    return generators[key]


def random_streams() -> dict:
    """Every random stream this rank's steps draw from: torch's CPU generator, the CUDA ones
    (once CUDA is initialised) and the TP generators (None until first drawn from)."""
    from smp.state import get_state, is_initialized

    generators = getattr(get_state(), "tp_generators", None) if is_initialized() else None
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "tp": None if generators is None else {k: g.get_state() for k, g in generators.items()},
    }


def set_random_streams(saved: dict) -> None:
    """Puts back what :func:`random_streams` took. TP generators that did not exist then are
    dropped, so they start afresh from their seed when next used, as they would have."""
    from smp.state import get_state, is_initialized

    torch.set_rng_state(saved["cpu"])
    if saved["cuda"] is not None:
        torch.cuda.set_rng_state_all(saved["cuda"])
    if is_initialized():
        if saved["tp"] is None:
            get_state().tp_generators = None
        else:
            generators = getattr(get_state(), "tp_generators", None) or {}
            for key in [k for k in generators if k not in saved["tp"]]:
                del generators[key]
            for key, value in saved["tp"].items():
                kind, _, device = key.partition("@")
                tp_rng(kind, device or None).set_state(value)


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

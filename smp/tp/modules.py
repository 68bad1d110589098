"""Distributed modules: layers whose parameters are split over a tensor-parallel group.

This module holds the base (:class:`DistributedModule`) and the single layers: linear, embedding
and LayerNorm; the transformer modules built from them are in smp/tp/transformer.py.

Every size given to a constructor is global (the whole layer's), never per rank. Each module's
non-distributed reference is named in its docstring: on any TP degree it computes what that
reference computes (up to floating-point summation order).

Batch semantics (api.md): by default each rank of a TP group holds different samples; the
outermost distributed module (the "TP region") all-gathers the group's batch on entry and hands
each rank its own samples back on exit; when the ranks' arguments differ (a padding mask on one
rank, None on another; other lengths), it runs each rank's arguments in turn instead
(smp/tp/region.py). With ``prescaled_batch=True`` all ranks already hold the same batch and
nothing is gathered.

Parameters carry two attributes that smp reads:
  - ``_smp_tp_split``: (dim, fused) if the parameter is a shard of a tensor split along ``dim``
    (``fused`` equal blocks each split on its own, e.g. 3 for fused QKV), None if replicated.
  - ``_smp_tp_reduce``: "rdp" if every rank of the TP group computes its gradient from the whole
    region batch (shards, and replicated tensors used inside the region): reduced over the
    reduced-data-parallel group. "dp" if computed from this rank's own samples only (LayerNorm in
    the "memory" layout of smp/tp/transformer.py): reduced over the data-parallel group, like a
    non-distributed parameter.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from smp.tp import functional as tpf
from smp.tp.region import run_region

__all__ = [
    "DistributedModule",
    "DistributedLinear",
    "DistributedEmbedding",
    "DistributedLayerNorm",
]


# ---- base ---------------------------------------------------------------------------------------
# The region entry and exit (smp's batch semantics, and the agreement of the TP ranks on a
# region's arguments) live in smp/tp/region.py.


class DistributedModule(nn.Module):
    """Base of every distributed module: holds the TP group and the shard metadata.

    Subclasses create parameters with :meth:`_shard` (split) or :meth:`_replicated`, and either
    implement ``local_forward`` (run inside :func:`run_region`) or override ``forward``.

    Args:
        group: the process group to split over; default smp's tensor-parallel group.
    """

    # The partitioner never splits a distributed module across pipeline stages: its forward is
    # one TP region and must run whole where its parameters are.
    _smp_atomic = True

    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.tp_group = tpf.tp_group(group)
        self.tp_size = self.tp_group.size()
        self.tp_rank = self.tp_group.rank()

    def forward(self, *args, **kwargs):
        return run_region(self, self.local_forward, args, kwargs)

    def local_forward(self, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement local_forward or forward")

    # -- parameters --

    def _check_divisible(self, what: str, value: int, multiple: int | None = None) -> None:
        multiple = self.tp_size if multiple is None else multiple
        if value % multiple:
            needs = (
                f"the tensor-parallel degree {self.tp_size}"
                if multiple == self.tp_size
                else f"{multiple} (the tensor-parallel degree {self.tp_size} x fused blocks)"
            )
            raise ValueError(
                f"{type(self).__name__}: {what} = {value} is not divisible by {needs}; choose "
                f"sizes that are multiples of {multiple} or a smaller tensor_parallel_degree"
            )

    def _shard(
        self,
        full: torch.Tensor,
        dim: int,
        fused: int = 1,
        reduce: str = "rdp",
    ) -> nn.Parameter:
        """A parameter holding this rank's shard of ``full`` (see functional.shard_tensor)."""
        local = tpf.shard_tensor(full, dim, fused, self.tp_size, self.tp_rank)
        param = nn.Parameter(local)
        param._smp_tp_split = (dim, fused)
        param._smp_tp_reduce = reduce
        return param

    def _replicated(self, full: torch.Tensor, reduce: str = "rdp") -> nn.Parameter:
        param = nn.Parameter(full)
        param._smp_tp_split = None
        param._smp_tp_reduce = reduce
        return param


def _tag(module: nn.Module, reduce: str) -> None:
    """Marks the (replicated) parameters of a plain submodule with their reduction class."""
    for p in module.parameters():
        p._smp_tp_split = None
        p._smp_tp_reduce = reduce


def _normal(shape: tuple[int, ...], std: float, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std)


def _uniform(shape: tuple[int, ...], fan_in: int, dtype, device) -> torch.Tensor:
    """nn.Linear's default initialisation (kaiming-uniform with a = sqrt(5), and its bias):
    U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return torch.empty(shape, dtype=dtype, device=device).uniform_(-bound, bound)


# ---- linear, embedding, layernorm ---------------------------------------------------------------


class DistributedLinear(DistributedModule):
    """A linear layer split over the TP group.  Reference: ``nn.Linear(in_features, out_features)``.

    ``split="column"``: the weight is split along the output features; the input is used whole
    (copy_to_region) and the output is gathered (``gather_output=True``) or left split.
    ``split="row"``: the weight is split along the input features; the input is split
    (scatter_to_region, unless ``input_is_parallel``) and the partial outputs are summed
    (reduce_from_region) before the bias is added.

    ``fused`` > 1 (column only): the output features are that many equal blocks (e.g. fused QKV)
    split block by block. ``transposed=True`` stores the weight as [in, out] (Hugging Face Conv1D).
    Weights start as N(0, ``initializer_range``) with zero biases; ``initializer_range=None`` is
    nn.Linear's own initialisation.

    Raises:
        ValueError: the split dimension is not divisible by the TP degree (× ``fused``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        split: str = "row",
        input_is_parallel: bool = False,
        gather_output: bool = True,
        fused: int = 1,
        transposed: bool = False,
        initializer_range: float | None = 0.02,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__(group)
        if split not in ("row", "column"):
            raise ValueError(f'DistributedLinear: split must be "row" or "column", got {split!r}')
        if fused != 1 and split != "column":
            raise ValueError("DistributedLinear: fused > 1 needs split='column'")
        self.in_features, self.out_features = in_features, out_features
        self.split, self.fused, self.transposed = split, fused, transposed
        self.input_is_parallel, self.gather_output = input_is_parallel, gather_output
        if split == "column" and fused > 1:
            self._check_divisible(
                f"out_features = {out_features} (fused blocks: {fused}) and out_features",
                out_features,
                fused * self.tp_size,
            )
        elif split == "column":
            self._check_divisible("out_features", out_features)
        else:
            self._check_divisible("in_features", in_features)
        dtype = dtype or torch.get_default_dtype()
        if initializer_range is None:
            full = _uniform((out_features, in_features), in_features, dtype, device)
            b = _uniform((out_features,), in_features, dtype, device)
        else:
            full = _normal((out_features, in_features), initializer_range, dtype, device)
            b = torch.zeros(out_features, dtype=dtype, device=device)
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        if transposed:
            full = full.t().contiguous()
        if split == "column":
            self.weight = self._shard(full, out_dim, fused)
            self.bias = self._shard(b, 0, fused) if bias else None
        else:
            self.weight = self._shard(full, in_dim)
            self.bias = self._replicated(b) if bias else None

    def local(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """The local product without communication (row: no bias, it is added after the sum;
        column: ``bias=False`` leaves it to the caller, a fused bias + activation)."""
        weight = self.weight.t() if self.transposed else self.weight
        if self.split == "column" and bias:
            return F.linear(x, weight, self.bias)
        return F.linear(x, weight)

    def local_forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.tp_group
        if self.split == "column":
            y = self.local(tpf.copy_to_region(x, group))
            if not self.gather_output:
                return y
            y = tpf.gather_from_region(y, -1, group)
            if self.fused > 1 and self.tp_size > 1:  # [r0: q k v | r1: q k v] -> [q | k | v]
                shape = y.shape[:-1]
                y = y.reshape(*shape, self.tp_size, self.fused, -1).transpose(-3, -2)
                y = y.reshape(*shape, -1)
            return y
        if not self.input_is_parallel:
            x = tpf.scatter_to_region(x, -1, group)
        y = tpf.reduce_from_region(self.local(x), group)
        # In the product's dtype, as nn.Linear's bias is under autocast.
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"split={self.split}, tp={self.tp_size}"
        )


class DistributedEmbedding(DistributedModule):
    """A vocab-parallel embedding: each rank holds ``num_embeddings / n`` rows.
    Reference: ``nn.Embedding(num_embeddings, embedding_dim, padding_idx)``.

    Each rank looks up the ids in its slice (zeros elsewhere) and the partial results are summed
    (one all-reduce; reduce-scatter along the batch when used by the "memory" layout).

    SMP v1's arguments are taken: ``_weight`` (the full weight, as ``full_weight``);
    ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` only at nn.Embedding's defaults (a
    ValueError otherwise); ``_skip_allgather`` / ``_skip_scatter_and_merge`` (v1's internal
    layout switches) have no effect: the rows are split along the vocabulary.
    ``initializer_range=None`` is nn.Embedding's own initialisation, N(0, 1).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        initializer_range: float | None = 0.02,
        _skip_allgather: bool = False,
        _skip_scatter_and_merge: bool = False,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        full_weight: torch.Tensor | None = None,
    ):
        super().__init__(group)
        if max_norm is not None or scale_grad_by_freq or sparse:
            raise ValueError(
                "DistributedEmbedding: max_norm, scale_grad_by_freq and sparse are not supported; "
                f"got max_norm={max_norm!r}, scale_grad_by_freq={scale_grad_by_freq!r}, "
                f"sparse={sparse!r}"
            )
        if full_weight is None:
            full_weight = _weight
        self._check_divisible("num_embeddings", num_embeddings)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.vocab_start = self.tp_rank * (num_embeddings // self.tp_size)
        dtype = dtype or torch.get_default_dtype()
        if full_weight is None:
            std = 1.0 if initializer_range is None else initializer_range
            full_weight = _normal((num_embeddings, embedding_dim), std, dtype, device)
            if padding_idx is not None:
                full_weight[padding_idx].zero_()
        self.weight = self._shard(full_weight, 0)

    def local(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's slice, zeros for ids outside it (no communication)."""
        local_ids = ids - self.vocab_start
        inside = (local_ids >= 0) & (local_ids < self.weight.size(0))
        out = F.embedding(torch.where(inside, local_ids, torch.zeros_like(local_ids)), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        if self.padding_idx is not None:  # nn.Embedding gives padding rows no gradient
            out = torch.where((ids == self.padding_idx).unsqueeze(-1), out.detach(), out)
        return out

    def local_forward(self, ids: torch.Tensor) -> torch.Tensor:
        return tpf.reduce_from_region(self.local(ids), self.tp_group)


class DistributedLayerNorm(DistributedModule):
    """LayerNorm whose features, weight and bias are split over the TP group; the mean and
    variance are all-reduced (distributed statistics).  Reference: ``nn.LayerNorm(normalized_shape,
    eps)`` over the last dimension.

    ``input_is_parallel=False`` (default): takes and returns whole features (split on entry,
    gathered on exit). True: takes and returns this rank's feature slice.
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        input_is_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__(group)
        if isinstance(normalized_shape, (tuple, list)):
            if len(normalized_shape) != 1:
                raise ValueError(
                    "DistributedLayerNorm normalises the last dimension only; got "
                    f"normalized_shape={tuple(normalized_shape)}"
                )
            normalized_shape = normalized_shape[0]
        self._check_divisible("normalized_shape", normalized_shape)
        self.normalized_shape, self.eps = normalized_shape, eps
        self.input_is_parallel = input_is_parallel
        dtype = dtype or torch.get_default_dtype()
        self.weight = self.bias = None
        if elementwise_affine:
            self.weight = self._shard(torch.ones(normalized_shape, dtype=dtype, device=device), 0)
            if bias:
                self.bias = self._shard(
                    torch.zeros(normalized_shape, dtype=dtype, device=device), 0
                )

    def sharded(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises ``x`` holding this rank's feature slice; returns the same slice."""
        n, group = self.normalized_shape, self.tp_group

        def total(t: torch.Tensor) -> torch.Tensor:
            # Summed over the ranks' feature slices and consumed by every slice: the gradient
            # must be summed too (all-reduce both ways), unlike reduce_from_region alone, whose
            # identity backward assumes a consumer that every rank computes the same.
            return tpf.copy_to_region(tpf.reduce_from_region(t, group), group)

        mean = total(x.sum(-1, keepdim=True)) / n
        centered = x - mean
        var = total((centered * centered).sum(-1, keepdim=True)) / n
        y = centered * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y

    def local_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            return self.sharded(x)
        y = self.sharded(tpf.scatter_to_region(x, -1, self.tp_group))
        return tpf.gather_from_region(y, -1, self.tp_group)

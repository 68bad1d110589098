"""Distributed modules: layers whose parameters are split over a tensor-parallel group.

Every size given to a constructor is global (the whole layer's), never per rank. Each module's
non-distributed reference is named in its docstring: on any TP degree it computes what that
reference computes (up to floating-point summation order).

Layout (``optimize`` in the config, or the ``optimize`` argument):
  - "speed" (Megatron-LM): column-parallel QKV and MLP-in, row-parallel attention-out and MLP-out,
    LayerNorm replicated on every rank: 2 all-reduces per transformer layer forward.
  - "memory": activations between sublayers stay split along the batch (each rank holds its own
    samples); a sublayer all-gathers its input and reduce-scatters its output: 2 all-gathers and
    2 reduce-scatters per layer forward (the same bytes), with no replicated activation.

Batch semantics (api.md): by default each rank of a TP group holds different samples; the
outermost distributed module (the "TP region") all-gathers the group's batch on entry and hands
each rank its own samples back on exit; when the ranks' arguments differ (a padding mask on one
rank, None on another; other lengths), it runs each rank's arguments in turn instead
(smp/nn/region.py). With ``prescaled_batch=True`` all ranks already hold the same batch and
nothing is gathered.

Parameters carry two attributes that smp reads:
  - ``_smp_tp_split``: (dim, fused) if the parameter is a shard of a tensor split along ``dim``
    (``fused`` equal blocks each split on its own, e.g. 3 for fused QKV), None if replicated.
  - ``_smp_tp_reduce``: "rdp" if every rank of the TP group computes its gradient from the whole
    region batch (shards, and replicated tensors used inside the region): reduced over the
    reduced-data-parallel group. "dp" if computed from this rank's own samples only (LayerNorm in
    the "memory" layout): reduced over the data-parallel group, like a non-distributed parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from smp.nn import functional as tpf
from smp.nn.region import _region_scope, batch_is_shared, in_region, run_region

__all__ = [
    "DistributedModule",
    "DistributedLinear",
    "DistributedEmbedding",
    "DistributedLayerNorm",
    "DistributedAttentionLayer",
    "DistributedTransformerOutputLayer",
    "DistributedTransformerLayer",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
]

_OPTIMIZE = ("speed", "memory")


# ---- regions ------------------------------------------------------------------------------------
# The region entry and exit (smp's batch semantics, and the agreement of the TP ranks on a
# region's arguments) live in smp/nn/region.py.


def _config_optimize() -> str:
    from smp.state import get_state, is_initialized

    return get_state().config.optimize if is_initialized() else "speed"


# ---- base ---------------------------------------------------------------------------------------


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
        initializer_range: float = 0.02,
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
        full = _normal((out_features, in_features), initializer_range, dtype, device)
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        if transposed:
            full = full.t().contiguous()
        if split == "column":
            self.weight = self._shard(full, out_dim, fused)
            b = torch.zeros(out_features, dtype=dtype, device=device)
            self.bias = self._shard(b, 0, fused) if bias else None
        else:
            self.weight = self._shard(full, in_dim)
            b = torch.zeros(out_features, dtype=dtype, device=device)
            self.bias = self._replicated(b) if bias else None

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """The local product without communication (row: no bias, it is added after the sum)."""
        weight = self.weight.t() if self.transposed else self.weight
        if self.split == "column":
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
        return y + self.bias if self.bias is not None else y

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
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        initializer_range: float = 0.02,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        full_weight: torch.Tensor | None = None,
    ):
        super().__init__(group)
        self._check_divisible("num_embeddings", num_embeddings)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.vocab_start = self.tp_rank * (num_embeddings // self.tp_size)
        dtype = dtype or torch.get_default_dtype()
        if full_weight is None:
            full_weight = _normal((num_embeddings, embedding_dim), initializer_range, dtype, device)
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


# ---- transformer --------------------------------------------------------------------------------

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class _Layout:
    """How activations cross a sublayer in one ``optimize`` mode (see the module docstring)."""

    def __init__(self, optimize: str, group: dist.ProcessGroup):
        self.memory = optimize == "memory"
        self.group = group

    def enter_sublayer(self, x: torch.Tensor) -> torch.Tensor:
        if self.memory:
            return tpf.all_gather(x, 0, self.group)
        return tpf.copy_to_region(x, self.group)

    def exit_sublayer(self, x: torch.Tensor) -> torch.Tensor:
        if self.memory:
            return tpf.reduce_scatter(x, 0, self.group)
        return tpf.reduce_from_region(x, self.group)

    @property
    def dropout_kind(self) -> str:
        return "sharded" if self.memory else "replicated"

    @property
    def replicated_reduce(self) -> str:
        return "dp" if self.memory else "rdp"


def _check_optimize(optimize: str | None) -> str:
    optimize = optimize or _config_optimize()
    if optimize not in _OPTIMIZE:
        raise ValueError(f'optimize must be "speed" or "memory", got {optimize!r}')
    return optimize


# What _check_divisible names when "memory" splits a batch that the TP ranks share.
_SHARED_BATCH = (
    "the batch size (optimize='memory' splits a batch the TP ranks share over them: with "
    "prescaled_batch, or one rank's batch when the ranks' arguments differ)"
)


class _TransformerRegion:
    """Entry and exit of a transformer region: where hidden states and the attention mask go
    between each rank's own samples and the batch the sublayers compute on ("core batch")."""

    @staticmethod
    def run(module, body: Callable, hidden: torch.Tensor, mask: torch.Tensor | None):
        """``body(hidden, mask)`` (the sublayers) as ``module``'s TP region, once the TP ranks
        agreed on the arguments (run_region)."""

        def region(hidden, mask):
            hidden, mask, leave = _TransformerRegion.enter(module, hidden, mask)
            with _region_scope():
                return leave(body(hidden, mask))

        return run_region(module, region, (hidden, mask), {}, moves_batch=False)

    @staticmethod
    def enter(module, hidden, mask):
        """Returns (hidden in the between-sublayer layout, mask for the core batch, exit fn)."""
        group, n = module.tp_group, module.tp_size
        if in_region() or n == 1:
            return hidden, mask, lambda h: h
        memory = module.optimize == "memory"
        if batch_is_shared():
            if not memory:
                return hidden, mask, lambda h: h
            module._check_divisible(_SHARED_BATCH, hidden.size(0))
            return (
                tpf.scatter_to_region(hidden, 0, group),
                mask,
                lambda h: tpf.gather_from_region(h, 0, group),
            )
        if mask is not None and mask.size(0) == hidden.size(0):
            mask = tpf.gather_from_region(mask, 0, group)
        if memory:
            return hidden, mask, lambda h: h
        return (
            tpf.gather_from_region(hidden, 0, group),
            mask,
            lambda h: tpf.scatter_to_region(h, 0, group),
        )


class DistributedAttentionLayer(DistributedModule):
    """Self-attention sublayer with residual and LayerNorm: heads split over the TP group.

    Reference (``pre_layernorm=False``, BERT): ``LN(x + dropout(Wo·attn(Wq x, Wk x, Wv x)))``;
    (``pre_layernorm=True``, GPT-2): ``x + dropout(Wo·attn(Wq LN(x), Wk LN(x), Wv LN(x)))``, with
    ``attn`` scaled dot-product attention over ``num_attention_heads`` heads, causal when
    ``causal_mask_size`` is set, plus an additive ``attention_mask`` ([B, 1, 1 or S, S]) if given.
    Parameters: ``query``, ``key``, ``value`` (column-parallel), ``dense`` (row-parallel),
    ``layernorm``.
    """

    def __init__(
        self,
        num_attention_heads: int,
        attention_head_size: int,
        hidden_size: int,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        pre_layernorm: bool = False,
        causal_mask_size: int | None = None,
        optimize: str | None = None,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__(group)
        self._check_divisible("num_attention_heads", num_attention_heads)
        self.optimize = _check_optimize(optimize)
        self.layout = _Layout(self.optimize, self.tp_group)
        self.num_attention_heads, self.attention_head_size = (
            num_attention_heads,
            attention_head_size,
        )
        self.local_heads = num_attention_heads // self.tp_size
        self.hidden_size = hidden_size
        self.attention_dropout_prob, self.hidden_dropout_prob = (
            attention_dropout_prob,
            hidden_dropout_prob,
        )
        self.pre_layernorm, self.causal = pre_layernorm, causal_mask_size is not None
        inner = num_attention_heads * attention_head_size
        kw = dict(
            initializer_range=initializer_range, group=self.tp_group, dtype=dtype, device=device
        )
        self.query = DistributedLinear(hidden_size, inner, split="column", **kw)
        self.key = DistributedLinear(hidden_size, inner, split="column", **kw)
        self.value = DistributedLinear(hidden_size, inner, split="column", **kw)
        self.dense = DistributedLinear(inner, hidden_size, split="row", **kw)
        self.dense.bias._smp_tp_reduce = self.layout.replicated_reduce
        self.layernorm = nn.LayerNorm(
            hidden_size, eps=layernorm_epsilon, dtype=dtype, device=device
        )
        _tag(self.layernorm, self.layout.replicated_reduce)

    def core(self, y: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of the local heads on the core batch ``y``; the row-parallel partial sum."""
        b, s, _ = y.shape
        h, d = self.local_heads, self.attention_head_size

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, h, d).transpose(1, 2)

        q, k, v = heads(self.query.local(y)), heads(self.key.local(y)), heads(self.value.local(y))
        p = self.attention_dropout_prob if self.training else 0.0
        if p == 0.0 and mask is None:
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        elif p == 0.0:
            ctx = F.scaled_dot_product_attention(
                q, k, v, attn_mask=_full_mask(mask, self.causal, s, q.dtype, q.device)
            )
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(d)
            full = _full_mask(mask, self.causal, s, scores.dtype, scores.device)
            if full is not None:
                scores = scores + full
            probs = tpf.tp_dropout(torch.softmax(scores, dim=-1), p, True, "sharded")
            ctx = probs @ v
        return self.dense.local(ctx.transpose(1, 2).reshape(b, s, h * d))

    def sublayer(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        inp = self.layernorm(x) if self.pre_layernorm else x
        out = self.layout.exit_sublayer(self.core(self.layout.enter_sublayer(inp), mask))
        out = tpf.tp_dropout(
            out + self.dense.bias, self.hidden_dropout_prob, self.training, self.layout.dropout_kind
        )
        x = x + out
        return x if self.pre_layernorm else self.layernorm(x)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None):
        return _TransformerRegion.run(self, self.sublayer, hidden_states, attention_mask)


def _full_mask(mask, causal: bool, s: int, dtype, device) -> torch.Tensor | None:
    """The additive mask: the user's (if any) plus the causal one."""
    full = None
    if causal:
        full = torch.zeros(s, s, dtype=dtype, device=device).masked_fill_(
            torch.ones(s, s, dtype=torch.bool, device=device).triu_(1), torch.finfo(dtype).min
        )
    if mask is not None:
        if mask.dtype == torch.bool:  # True = attend
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(
                ~mask, torch.finfo(dtype).min
            )
        mask = mask.to(dtype)
        full = mask if full is None else torch.clamp(full + mask, min=torch.finfo(dtype).min)
    return full


class DistributedTransformerOutputLayer(DistributedModule):
    """MLP sublayer with residual and LayerNorm: ``intermediate_size`` split over the TP group.

    Reference (``pre_layernorm=False``): ``LN(x + dropout(W2·act(W1 x)))``; (True):
    ``x + dropout(W2·act(W1 LN(x)))``. Parameters: ``dense1`` (column-parallel), ``dense2``
    (row-parallel), ``layernorm``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "gelu",
        hidden_dropout_prob: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        pre_layernorm: bool = False,
        optimize: str | None = None,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__(group)
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}"
            )
        self._check_divisible("intermediate_size", intermediate_size)
        self.optimize = _check_optimize(optimize)
        self.layout = _Layout(self.optimize, self.tp_group)
        self.activation = activation
        self.hidden_dropout_prob, self.pre_layernorm = hidden_dropout_prob, pre_layernorm
        kw = dict(
            initializer_range=initializer_range, group=self.tp_group, dtype=dtype, device=device
        )
        self.dense1 = DistributedLinear(hidden_size, intermediate_size, split="column", **kw)
        self.dense2 = DistributedLinear(intermediate_size, hidden_size, split="row", **kw)
        self.dense2.bias._smp_tp_reduce = self.layout.replicated_reduce
        self.layernorm = nn.LayerNorm(
            hidden_size, eps=layernorm_epsilon, dtype=dtype, device=device
        )
        _tag(self.layernorm, self.layout.replicated_reduce)

    def sublayer(self, x: torch.Tensor) -> torch.Tensor:
        inp = self.layernorm(x) if self.pre_layernorm else x
        y = self.layout.enter_sublayer(inp)
        y = self.dense2.local(_ACTIVATIONS[self.activation](self.dense1.local(y)))
        out = self.layout.exit_sublayer(y)
        out = tpf.tp_dropout(
            out + self.dense2.bias,
            self.hidden_dropout_prob,
            self.training,
            self.layout.dropout_kind,
        )
        x = x + out
        return x if self.pre_layernorm else self.layernorm(x)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _TransformerRegion.run(self, lambda h, _: self.sublayer(h), hidden_states, None)


class DistributedTransformerLayer(DistributedModule):
    """One transformer layer: :class:`DistributedAttentionLayer` then
    :class:`DistributedTransformerOutputLayer` (its reference: the two references in sequence).

    Args:
        num_attention_heads, attention_head_size, hidden_size, intermediate_size: global sizes;
            heads and intermediate_size must divide by the TP degree.
        pre_layernorm: GPT-2 style (True) or BERT style (False).
        causal_mask_size: set (to the maximum sequence length) for causal attention.
        optimize: "speed" or "memory" (default: the config's).
    """

    def __init__(
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        pre_layernorm: bool = False,
        causal_mask_size: int | None = None,
        optimize: str | None = None,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__(group)
        self.optimize = _check_optimize(optimize)
        common = dict(
            optimize=self.optimize,
            group=self.tp_group,
            dtype=dtype,
            device=device,
            layernorm_epsilon=layernorm_epsilon,
            initializer_range=initializer_range,
            pre_layernorm=pre_layernorm,
            hidden_dropout_prob=hidden_dropout_prob,
        )
        self.attention = DistributedAttentionLayer(
            num_attention_heads,
            attention_head_size,
            hidden_size,
            attention_dropout_prob=attention_dropout_prob,
            causal_mask_size=causal_mask_size,
            **common,
        )
        self.output = DistributedTransformerOutputLayer(
            hidden_size, intermediate_size, activation=activation, **common
        )

    def sublayers(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output.sublayer(self.attention.sublayer(x, mask))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None):
        return _TransformerRegion.run(self, self.sublayers, hidden_states, attention_mask)


class DistributedTransformer(DistributedModule):
    """``num_layers`` :class:`DistributedTransformerLayer` s in sequence, one TP region (the
    batch is gathered once, not per layer). Keyword arguments are those of the layer."""

    def __init__(self, num_layers: int = 12, group: dist.ProcessGroup | None = None, **layer):
        super().__init__(group)
        self.optimize = _check_optimize(layer.pop("optimize", None))
        self.num_layers = num_layers
        self.seq_layers = nn.ModuleList(
            DistributedTransformerLayer(optimize=self.optimize, group=self.tp_group, **layer)
            for _ in range(num_layers)
        )

    def sublayers(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.seq_layers:
            x = layer.sublayers(x, mask)
        return x

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None):
        return _TransformerRegion.run(self, self.sublayers, hidden_states, attention_mask)


class DistributedTransformerLMHead(DistributedModule):
    """A whole language model: vocab-parallel token embedding + learned positions, a
    :class:`DistributedTransformer`, a final LayerNorm (pre-LN models), and an output projection
    tied to the token embedding, with a vocab-parallel cross-entropy.

    Reference: the same model with every split undone (``tensor_parallel_degree=1``):
    ``logits = LN_f(T(E[ids] + P[pos])) @ E^T``.

    ``forward(input_ids, attention_mask=None, labels=None)``:
      - ``labels`` None: the full logits [B, S, V] (gathered over the vocabulary).
      - ``labels`` given ([B, S] token ids, already aligned with the positions; ``-100`` ignored):
        the per-token loss [B, S], computed without ever gathering the logits.
    """

    def __init__(
        self,
        num_layers: int = 12,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        vocab_size: int = 30522,
        num_positions: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        embedding_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        pre_layernorm: bool = True,
        causal_mask_size: int | None = None,
        optimize: str | None = None,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__(group)
        self.optimize = _check_optimize(optimize)
        self.layout = _Layout(self.optimize, self.tp_group)
        self.vocab_size, self.num_positions = vocab_size, num_positions
        self.embedding_dropout_prob, self.pre_layernorm = embedding_dropout_prob, pre_layernorm
        self.word_embedding = DistributedEmbedding(
            vocab_size,
            hidden_size,
            initializer_range=initializer_range,
            group=self.tp_group,
            dtype=dtype,
            device=device,
        )
        self.position_embedding = nn.Embedding(
            num_positions, hidden_size, dtype=dtype, device=device
        )
        nn.init.normal_(self.position_embedding.weight, 0.0, initializer_range)
        _tag(self.position_embedding, self.layout.replicated_reduce)
        self.transformer = DistributedTransformer(
            num_layers,
            group=self.tp_group,
            optimize=self.optimize,
            num_attention_heads=num_attention_heads,
            attention_head_size=attention_head_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            attention_dropout_prob=attention_dropout_prob,
            hidden_dropout_prob=hidden_dropout_prob,
            activation=activation,
            layernorm_epsilon=layernorm_epsilon,
            initializer_range=initializer_range,
            pre_layernorm=pre_layernorm,
            causal_mask_size=causal_mask_size,
            dtype=dtype,
            device=device,
        )
        self.layernorm = None
        if pre_layernorm:
            self.layernorm = nn.LayerNorm(
                hidden_size, eps=layernorm_epsilon, dtype=dtype, device=device
            )
            _tag(self.layernorm, self.layout.replicated_reduce)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return run_region(
            self, self._forward, (input_ids, attention_mask, labels), {}, moves_batch=False
        )

    def _forward(self, input_ids, attention_mask, labels):
        group, n = self.tp_group, self.tp_size
        top = not in_region() and n > 1
        prescaled = batch_is_shared()
        memory = self.optimize == "memory"
        ids, mask = input_ids, attention_mask
        if top and not prescaled:  # the group's batch: every sublayer computes on it
            ids = tpf.gather_from_region(ids, 0, group)
            if labels is not None:
                labels = tpf.gather_from_region(labels, 0, group)
            if mask is not None and mask.size(0) == input_ids.size(0):
                mask = tpf.gather_from_region(mask, 0, group)
        if memory and top and prescaled:
            self._check_divisible(_SHARED_BATCH, ids.size(0))
        with _region_scope():
            partial = self.word_embedding.local(ids)
            if memory:  # between sublayers: this rank's chunk of the batch
                hidden = tpf.reduce_scatter(partial, 0, group)
            else:
                hidden = tpf.reduce_from_region(partial, group)
            positions = torch.arange(ids.size(1), device=ids.device)
            hidden = hidden + self.position_embedding(positions)
            hidden = tpf.tp_dropout(
                hidden, self.embedding_dropout_prob, self.training, self.layout.dropout_kind
            )
            hidden = self.transformer.sublayers(hidden, mask)
            if self.layernorm is not None:
                hidden = self.layernorm(hidden)
            hidden = self.layout.enter_sublayer(hidden)  # the core batch, whole on every rank
            logits = F.linear(hidden, self.word_embedding.weight)
            if labels is None:
                out = tpf.gather_from_region(logits, -1, group)
            else:
                out = tpf.vocab_parallel_cross_entropy(
                    logits, labels, self.word_embedding.vocab_start, group
                )
        if top and not prescaled:
            out = tpf.scatter_to_region(out, 0, group)
        return out

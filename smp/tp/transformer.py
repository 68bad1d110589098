"""Distributed transformer modules: the attention and MLP sublayers, a transformer layer, a
stack of layers, and a whole language model, built from the base, linear and embedding modules
of smp/tp/modules.py (whose docstring gives the batch semantics and the parameter attributes).

Layout (``optimize`` in the config, or the ``optimize`` argument):
  - "speed" (Megatron-LM): column-parallel QKV and MLP-in, row-parallel attention-out and MLP-out,
    LayerNorm replicated on every rank: 2 all-reduces per transformer layer forward.
  - "memory": activations between sublayers stay split along the batch (each rank holds its own
    samples); a sublayer all-gathers its input and reduce-scatters its output: 2 all-gathers and
    2 reduce-scatters per layer forward (the same bytes), with no replicated activation.

One file of a little over 800 lines: the five modules share the layout, the region entry and the
sublayer base above, and are read together.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from smp import kernels
from smp.core.unbuilt import fail
from smp.tp import functional as tpf
from smp.tp.modules import DistributedEmbedding, DistributedLinear, DistributedModule, _tag
from smp.tp.region import _region_scope, batch_is_shared, in_region, run_region

__all__ = [
    "DistributedAttentionLayer",
    "DistributedTransformerOutputLayer",
    "DistributedTransformerLayer",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
]

_OPTIMIZE = ("speed", "memory")
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
_GELU_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh"}  # those smp.kernels.bias_gelu fuses


def _config_optimize() -> str:
    from smp.state import get_state, is_initialized

    return get_state().config.optimize if is_initialized() else "speed"


# ---- layout and region --------------------------------------------------------------------------


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
    between each rank's own samples and the batch the sublayers compute on ("core batch").
    Cross-attention states travel as the hidden states do, their mask as the attention mask."""

    @staticmethod
    def run(module, body: Callable, hidden, mask, cross=None, cross_mask=None):
        """``body(hidden, mask, cross, cross_mask)`` (the sublayers) as ``module``'s TP region,
        once the TP ranks agreed on the arguments (run_region)."""

        def region(hidden, mask, cross, cross_mask):
            hidden, mask, leave, enter = _TransformerRegion.enter(module, hidden, mask)
            if cross is not None:
                cross_mask = _TransformerRegion.mask(module, cross_mask, cross.size(0))
                cross = enter(cross)
            with _region_scope():
                return leave(body(hidden, mask, cross, cross_mask))

        return run_region(module, region, (hidden, mask, cross, cross_mask), {}, moves_batch=False)

    @staticmethod
    def enter(module, hidden, mask):
        """(hidden in the between-sublayer layout, mask for the core batch, exit fn, the entry
        fn for another tensor that travels as ``hidden`` does)."""
        group, n = module.tp_group, module.tp_size
        if in_region() or n == 1:
            return hidden, mask, _same, _same
        memory = module.optimize == "memory"
        if batch_is_shared():
            if not memory:
                return hidden, mask, _same, _same
            module._check_divisible(_SHARED_BATCH, hidden.size(0))
            return (
                tpf.scatter_to_region(hidden, 0, group),
                mask,
                lambda h: tpf.gather_from_region(h, 0, group),
                lambda t: tpf.scatter_to_region(t, 0, group),
            )
        mask = _TransformerRegion.mask(module, mask, hidden.size(0))
        if memory:
            return hidden, mask, _same, _same
        return (
            tpf.gather_from_region(hidden, 0, group),
            mask,
            lambda h: tpf.scatter_to_region(h, 0, group),
            lambda t: tpf.gather_from_region(t, 0, group),
        )

    @staticmethod
    def mask(module, mask, rows: int):
        """A mask for the core batch: the group's rows when the ranks hold their own samples."""
        if mask is None or mask.size(0) != rows or in_region() or module.tp_size == 1:
            return mask
        if batch_is_shared():
            return mask
        return tpf.gather_from_region(mask, 0, module.tp_group)


def _same(t):
    return t


def _check_norms(pre_layernorm: bool, post_layernorm: bool) -> None:
    if not (pre_layernorm or post_layernorm):
        raise ValueError(
            "at least one of pre_layernorm and post_layernorm must be True (SMP v1's rule); got "
            "both False"
        )


def _residual(x: torch.Tensor, out: torch.Tensor, fp32: bool) -> torch.Tensor:
    """``x + out``; with ``fp32`` added in float32 and cast back (v1's fp32_residual_addition)."""
    if fp32 and x.dtype != torch.float32:
        return (x.float() + out.float()).to(x.dtype)
    return x + out


def _std(initializer_range: float, use_normal_initialization: bool) -> float | None:
    """The normal std of v1's initialisation rule; None is torch's default initialisation."""
    return initializer_range if use_normal_initialization else None


def _unpack(inputs: tuple, names: tuple[str, ...], what: str) -> list:
    if len(inputs) != len(names):
        raise ValueError(
            f"{what}: a tuple input is ({', '.join(names)}) (SMP v1's convention), got a tuple "
            f"of {len(inputs)}"
        )
    return list(inputs)


class _Sublayer(DistributedModule):
    """What the attention and output sublayers share: the layout, the LayerNorms at the input
    (``pre_layernorm``) and/or on the residual sum (``post_layernorm``, the module named
    ``layernorm``), the residual (in fp32 with ``fp32_residual_addition``)."""

    def _norms(self, hidden_size, pre, post, eps, dtype, device):
        _check_norms(pre, post)
        self.pre_layernorm = self.layernorm = None
        if pre:
            self.pre_layernorm = nn.LayerNorm(hidden_size, eps=eps, dtype=dtype, device=device)
            _tag(self.pre_layernorm, self.layout.replicated_reduce)
        if post:
            self.layernorm = nn.LayerNorm(hidden_size, eps=eps, dtype=dtype, device=device)
            _tag(self.layernorm, self.layout.replicated_reduce)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre_layernorm(x) if self.pre_layernorm is not None else x

    def _output(self, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = tpf.tp_dropout(
            out + bias.to(out.dtype),
            self.hidden_dropout_prob,
            self.training,
            self.layout.dropout_kind,
        )
        x = _residual(x, out, self.fp32_residual_addition)
        return self.layernorm(x) if self.layernorm is not None else x


class DistributedAttentionLayer(_Sublayer):
    """Attention sublayer with residual and LayerNorm(s): heads split over the TP group.

    Reference (SMP v1's, residual kept in every case):
    ``y = dropout(Wo·attn(Wq LNpre(x), Wk s, Wv s)) + x`` then ``LNpost(y)``, with ``s = LNpre(x)``
    (self-attention) or ``cross_states`` (``cross_attention=True``), ``LNpre`` / ``LNpost``
    present with ``pre_layernorm`` / ``post_layernorm``, ``attn`` scaled dot-product attention
    over ``num_attention_heads`` heads, causal when ``causal_mask_size`` is set (self-attention
    only), plus an additive ``attention_mask`` ([N, 1, 1 or S, S]; a bool mask is True where to
    attend). Parameters: ``query``, ``key``, ``value`` (column-parallel), ``dense`` (row-parallel),
    ``pre_layernorm``, ``layernorm``.

    ``forward(hidden_states, attention_mask=None, cross_states=None)`` (the first argument is
    named ``inputs``, as in v1), or v1's tuple:
    ``forward((hidden_states, attention_mask))`` / ``forward((hidden_states, cross_states,
    attention_mask))``. Returns the output tensor.
    """

    def __init__(
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        cross_attention: bool = False,
        causal_mask_size: int | None = None,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        fp32_residual_addition: bool = False,
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
        self.cross_attention = cross_attention
        self.causal = causal_mask_size is not None and not cross_attention
        self.fp32_residual_addition = fp32_residual_addition
        inner = num_attention_heads * attention_head_size
        kw = dict(
            initializer_range=_std(initializer_range, use_normal_initialization),
            group=self.tp_group,
            dtype=dtype,
            device=device,
        )
        self.query = DistributedLinear(hidden_size, inner, split="column", **kw)
        self.key = DistributedLinear(hidden_size, inner, split="column", **kw)
        self.value = DistributedLinear(hidden_size, inner, split="column", **kw)
        self.dense = DistributedLinear(inner, hidden_size, split="row", **kw)
        self.dense.bias._smp_tp_reduce = self.layout.replicated_reduce
        self._norms(hidden_size, pre_layernorm, post_layernorm, layernorm_epsilon, dtype, device)

    def core(self, y: torch.Tensor, mask: torch.Tensor | None, kv: torch.Tensor) -> torch.Tensor:
        """Attention of the local heads (queries from ``y``, keys and values from ``kv``, both
        on the core batch); the row-parallel partial sum."""
        b, s, _ = y.shape
        h, d = self.local_heads, self.attention_head_size

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, t.size(1), h, d).transpose(1, 2)

        q, k, v = heads(self.query.local(y)), heads(self.key.local(kv)), heads(self.value.local(kv))
        p = self.attention_dropout_prob if self.training else 0.0
        if p == 0.0 and mask is None:
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        elif p == 0.0:
            full = _full_mask(mask, self.causal, s, kv.size(1), q.dtype, q.device)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=full)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(d)
            full = _full_mask(mask, self.causal, s, kv.size(1), scores.dtype, scores.device)
            if full is not None:
                scores = scores + full
            probs = tpf.tp_dropout(torch.softmax(scores, dim=-1), p, True, "sharded")
            ctx = probs @ v
        return self.dense.local(ctx.transpose(1, 2).reshape(b, s, h * d))

    def sublayer(self, x, mask, cross=None) -> torch.Tensor:
        if self.cross_attention and cross is None:
            raise ValueError(
                "DistributedAttentionLayer(cross_attention=True) needs cross_states: call it with "
                "(hidden_states, cross_states, attention_mask)"
            )
        y = self.layout.enter_sublayer(self._input(x))
        kv = y if not self.cross_attention else self.layout.enter_sublayer(cross)
        out = self.layout.exit_sublayer(self.core(y, mask, kv))
        return self._output(x, out, self.dense.bias)

    def forward(self, inputs, attention_mask=None, cross_states=None):
        hidden_states = inputs
        if isinstance(hidden_states, (tuple, list)):
            names = ("hidden_states", "attention_mask")
            if self.cross_attention:
                names = ("hidden_states", "cross_states", "attention_mask")
            parts = _unpack(hidden_states, names, "DistributedAttentionLayer")
            hidden_states, attention_mask = parts[0], parts[-1]
            cross_states = parts[1] if self.cross_attention else None
        if self.cross_attention:  # the mask is over the cross states' positions
            return _TransformerRegion.run(
                self,
                lambda h, _, c, cm: self.sublayer(h, cm, c),
                hidden_states,
                None,
                cross_states,
                attention_mask,
            )
        return _TransformerRegion.run(
            self, lambda h, m, *_: self.sublayer(h, m), hidden_states, attention_mask
        )


def _full_mask(mask, causal: bool, s: int, t: int, dtype, device) -> torch.Tensor | None:
    """The additive mask over [s queries, t keys]: the user's (if any) plus the causal one."""
    full = None
    if causal:
        full = torch.zeros(s, t, dtype=dtype, device=device).masked_fill_(
            torch.ones(s, t, dtype=torch.bool, device=device).triu_(1), torch.finfo(dtype).min
        )
    if mask is not None:
        if mask.dtype == torch.bool:  # True = attend
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(
                ~mask, torch.finfo(dtype).min
            )
        mask = mask.to(dtype)
        full = mask if full is None else torch.clamp(full + mask, min=torch.finfo(dtype).min)
    return full


class DistributedTransformerOutputLayer(_Sublayer):
    """MLP sublayer with residual and LayerNorm(s): ``intermediate_size`` split over the TP group.

    Reference: ``y = dropout(W2·act(W1 LNpre(x))) + x`` then ``LNpost(y)`` (LayerNorms as in
    :class:`DistributedAttentionLayer`). Parameters: ``dense1`` (column-parallel), ``dense2``
    (row-parallel), ``pre_layernorm``, ``layernorm``.
    """

    def __init__(
        self,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        fp32_residual_addition: bool = False,
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
        self.hidden_dropout_prob = hidden_dropout_prob
        self.fp32_residual_addition = fp32_residual_addition
        kw = dict(
            initializer_range=_std(initializer_range, use_normal_initialization),
            group=self.tp_group,
            dtype=dtype,
            device=device,
        )
        self.dense1 = DistributedLinear(hidden_size, intermediate_size, split="column", **kw)
        self.dense2 = DistributedLinear(intermediate_size, hidden_size, split="row", **kw)
        self.dense2.bias._smp_tp_reduce = self.layout.replicated_reduce
        self._norms(hidden_size, pre_layernorm, post_layernorm, layernorm_epsilon, dtype, device)

    def sublayer(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layout.enter_sublayer(self._input(x))
        y = self.dense2.local(self._activated(y))
        return self._output(x, self.layout.exit_sublayer(y), self.dense2.bias)

    def _activated(self, y: torch.Tensor) -> torch.Tensor:
        approximate = _GELU_APPROXIMATE.get(self.activation)
        if approximate and self.dense1.bias is not None and kernels.fused_enabled("bias_gelu"):
            return kernels.bias_gelu(
                self.dense1.local(y, bias=False), self.dense1.bias, approximate
            )
        return _ACTIVATIONS[self.activation](self.dense1.local(y))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _TransformerRegion.run(self, lambda h, *_: self.sublayer(h), hidden_states, None)


def _layer_inputs(module, args: tuple, kwargs: dict) -> tuple[bool, list]:
    """(whether the call used v1's tuple, [hidden, mask, cross, cross_mask])."""
    if args and isinstance(args[0], (tuple, list)):
        if len(args) > 1 or kwargs:
            raise ValueError(
                f"{type(module).__name__}: a tuple input is the only argument (SMP v1's convention)"
            )
        if module.add_cross_attention:
            h, cross, mask, cross_mask = _unpack(
                args[0],
                ("hidden_states", "cross_states", "attention_mask", "cross_mask"),
                type(module).__name__,
            )
            return True, [h, mask, cross, cross_mask]
        h, mask = _unpack(args[0], ("hidden_states", "attention_mask"), type(module).__name__)
        return True, [h, mask, None, None]
    bound = inspect.signature(module._keywords).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    return False, [a["hidden_states"], a["attention_mask"], a["cross_states"], a["cross_mask"]]


def _layer_outputs(as_tuple: bool, add_cross: bool, out, mask, cross, cross_mask):
    if not as_tuple:
        return out
    return (out, cross, mask, cross_mask) if add_cross else (out, mask)


class _LayerCall:
    """The call of a transformer layer or stack: keywords, or v1's one tuple (returned as a
    tuple: the output, then the other inputs unchanged)."""

    @staticmethod
    def _keywords(hidden_states, attention_mask=None, cross_states=None, cross_mask=None):
        """The keyword form of ``forward``'s arguments."""

    def forward(self, inputs=None, *args, **kwargs):
        if inputs is not None:
            args = (inputs, *args)
        as_tuple, (h, mask, cross, cross_mask) = _layer_inputs(self, args, kwargs)
        out = _TransformerRegion.run(self, self.sublayers, h, mask, cross, cross_mask)
        return _layer_outputs(as_tuple, self.add_cross_attention, out, mask, cross, cross_mask)


class DistributedTransformerLayer(_LayerCall, DistributedModule):
    """One transformer layer: :class:`DistributedAttentionLayer`, with ``add_cross_attention``
    a cross-attention :class:`DistributedAttentionLayer` (``cross_attention``), then
    :class:`DistributedTransformerOutputLayer` (its reference: the references in sequence).

    Args (SMP v1's, sizes global):
        num_attention_heads, attention_head_size, hidden_size, intermediate_size: heads and
            intermediate_size must divide by the TP degree.
        attention_dropout_prob, hidden_dropout_prob, activation ("gelu", "gelu_new", "relu",
            "silu"), layernorm_epsilon.
        initializer_range, use_normal_initialization: weights ~ N(0, initializer_range) when
            True, else torch's default initialisation of nn.Linear (v1's default).
        causal_mask_size: set (to the maximum sequence length) for causal self-attention.
        add_cross_attention: a cross-attention sublayer after the self-attention.
        pre_layernorm, post_layernorm: LayerNorm on each sublayer's input (GPT-2 style) and/or
            on its residual sum (BERT style, the default); at least one must be True.
        fp32_residual_addition: add the residuals in float32.
        use_alibi, alibi_bias_max: ALiBi attention biases (v1.15); not built yet: True fails.
        optimize: "speed" or "memory" (default: the config's).

    ``forward(hidden_states, attention_mask=None, cross_states=None, cross_mask=None)`` returns
    the output tensor; v1's ``forward((hidden_states, attention_mask))`` (or ``(hidden_states,
    cross_states, attention_mask, cross_mask)``) returns v1's tuple: the output, then the other
    inputs unchanged.
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
        use_normal_initialization: bool = False,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        fp32_residual_addition: bool = False,
        use_alibi: bool = False,
        alibi_bias_max: int = 8,
        optimize: str | None = None,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__(group)
        _check_norms(pre_layernorm, post_layernorm)
        if use_alibi:
            fail("smp.nn.DistributedTransformerLayer(use_alibi=True)", "ALiBi attention biases")
        self.optimize = _check_optimize(optimize)
        self.add_cross_attention = add_cross_attention
        common = dict(
            optimize=self.optimize,
            group=self.tp_group,
            dtype=dtype,
            device=device,
            layernorm_epsilon=layernorm_epsilon,
            initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization,
            pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm,
            fp32_residual_addition=fp32_residual_addition,
            hidden_dropout_prob=hidden_dropout_prob,
        )
        heads = (num_attention_heads, attention_head_size, hidden_size)
        self.attention = DistributedAttentionLayer(
            *heads,
            attention_dropout_prob=attention_dropout_prob,
            causal_mask_size=causal_mask_size,
            **common,
        )
        if add_cross_attention:
            self.cross_attention = DistributedAttentionLayer(
                *heads, attention_dropout_prob=attention_dropout_prob, cross_attention=True,
                **common,
            )  # fmt: skip
        self.output = DistributedTransformerOutputLayer(
            hidden_size, intermediate_size, activation=activation, **common
        )

    def sublayers(self, x, mask, cross=None, cross_mask=None) -> torch.Tensor:
        x = self.attention.sublayer(x, mask)
        if self.add_cross_attention:
            x = self.cross_attention.sublayer(x, cross_mask, cross)
        return self.output.sublayer(x)


class DistributedTransformer(_LayerCall, DistributedModule):
    """``num_layers`` :class:`DistributedTransformerLayer` s in sequence (``seq_layers``), one TP
    region (the batch is gathered once, not per layer). Keyword arguments and ``forward`` are
    those of the layer."""

    def __init__(self, num_layers: int = 12, group: dist.ProcessGroup | None = None, **layer):
        super().__init__(group)
        self.optimize = _check_optimize(layer.pop("optimize", None))
        self.num_layers = num_layers
        self.add_cross_attention = layer.get("add_cross_attention", False)
        self.seq_layers = nn.ModuleList(
            DistributedTransformerLayer(optimize=self.optimize, group=self.tp_group, **layer)
            for _ in range(num_layers)
        )

    def sublayers(self, x, mask, cross=None, cross_mask=None) -> torch.Tensor:
        for layer in self.seq_layers:
            x = layer.sublayers(x, mask, cross, cross_mask)
        return x


def _padding_mask(mask: torch.Tensor, dtype) -> torch.Tensor:
    """A [N, S] 0/1 mask (1: a token to attend to, as tokenizers give it) as the additive
    [N, 1, 1, S] mask the layers take; other shapes are already additive (or bool)."""
    if mask.dim() != 2:
        return mask
    keep = mask.bool() if mask.dtype == torch.bool else mask != 0
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~keep, torch.finfo(dtype).min)[:, None, None, :]


class DistributedTransformerLMHead(DistributedModule):
    """A whole language model: vocab-parallel token embedding + learned positions (+ token types
    with ``num_token_types`` > 0), a :class:`DistributedTransformer`, a final LayerNorm when the
    layers are pre-LN only (``layernorm``), and with ``add_lm_head`` an output projection tied
    to the token embedding with a vocab-parallel cross-entropy.

    Reference: the same model with every split undone (``tensor_parallel_degree=1``):
    ``logits = LN_f(T(E[ids] + P[pos] + TT[types])) @ E^T``.

    ``forward(input_ids, attention_mask=None, labels=None, token_type_ids=None,
    position_ids=None, cross_states=None, cross_mask=None)``, or v1's tuple
    ``forward((input_ids, attention_mask, token_type_ids, position_ids, labels))`` (with
    ``add_cross_attention``: ``(input_ids, attention_mask, token_type_ids, position_ids,
    cross_states, cross_mask, labels)``):
      - ``attention_mask`` [N, S]: 1 for tokens to attend to, 0 for padding (as Hugging Face
        tokenizers give it); a 4-d mask is taken as additive.
      - ``labels`` None: the full logits [N, S, V] (gathered over the vocabulary); without
        ``add_lm_head``, the hidden states [N, S, H].
      - ``labels`` given ([N, S] token ids, already aligned with the positions; ``-100``
        ignored): the per-token loss [N, S], computed without ever gathering the logits.
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
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        num_token_types: int = 0,
        causal_mask_size: int | None = None,
        add_cross_attention: bool = False,
        add_lm_head: bool = True,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        fp32_residual_addition: bool = False,
        embedding_dropout_prob: float | None = None,
        optimize: str | None = None,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__(group)
        _check_norms(pre_layernorm, post_layernorm)
        self.optimize = _check_optimize(optimize)
        self.layout = _Layout(self.optimize, self.tp_group)
        self.vocab_size, self.num_positions = vocab_size, num_positions
        self.add_cross_attention, self.add_lm_head = add_cross_attention, add_lm_head
        # v1 has no embedding dropout argument: its embeddings use hidden_dropout_prob.
        if embedding_dropout_prob is None:
            embedding_dropout_prob = hidden_dropout_prob
        self.embedding_dropout_prob = embedding_dropout_prob
        std = _std(initializer_range, use_normal_initialization)
        self.word_embedding = DistributedEmbedding(
            vocab_size,
            hidden_size,
            initializer_range=std,
            group=self.tp_group,
            dtype=dtype,
            device=device,
        )
        self.position_embedding = nn.Embedding(
            num_positions, hidden_size, dtype=dtype, device=device
        )
        self.token_type_embedding = None
        if num_token_types > 0:
            self.token_type_embedding = nn.Embedding(
                num_token_types, hidden_size, dtype=dtype, device=device
            )
        for table in (self.position_embedding, self.token_type_embedding):
            if table is not None:
                if std is not None:
                    nn.init.normal_(table.weight, 0.0, std)
                _tag(table, self.layout.replicated_reduce)
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
            use_normal_initialization=use_normal_initialization,
            causal_mask_size=causal_mask_size,
            add_cross_attention=add_cross_attention,
            pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm,
            fp32_residual_addition=fp32_residual_addition,
            dtype=dtype,
            device=device,
        )
        self.layernorm = None
        if pre_layernorm and not post_layernorm:  # a pre-LN stack ends with a final norm
            self.layernorm = nn.LayerNorm(
                hidden_size, eps=layernorm_epsilon, dtype=dtype, device=device
            )
            _tag(self.layernorm, self.layout.replicated_reduce)

    @staticmethod
    def _keywords(
        input_ids,
        attention_mask=None,
        labels=None,
        token_type_ids=None,
        position_ids=None,
        cross_states=None,
        cross_mask=None,
    ):
        """The keyword form of ``forward``'s arguments."""

    def forward(self, inputs=None, *args, **kwargs):
        if inputs is not None:
            args = (inputs, *args)
        if args and isinstance(args[0], (tuple, list)):
            if len(args) > 1 or kwargs:
                raise ValueError(
                    "DistributedTransformerLMHead: a tuple input is the only argument (SMP v1)"
                )
            names = ["input_ids", "attention_mask", "token_type_ids", "position_ids"]
            names += ["cross_states", "cross_mask"] if self.add_cross_attention else []
            values = dict(zip(names + ["labels"], _unpack(args[0], (*names, "labels"), "LMHead")))
        else:
            bound = inspect.signature(self._keywords).bind(*args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
        if values.get("cross_states") is not None and not self.add_cross_attention:
            raise ValueError(
                "DistributedTransformerLMHead got cross_states but was built without "
                "add_cross_attention=True"
            )
        if values["labels"] is not None and not self.add_lm_head:
            raise ValueError(
                "DistributedTransformerLMHead(add_lm_head=False) returns hidden states and "
                "takes no labels"
            )
        order = ("input_ids", "attention_mask", "labels", "token_type_ids", "position_ids")
        order += ("cross_states", "cross_mask")
        call = tuple(values.get(k) for k in order)
        return run_region(self, self._forward, call, {}, moves_batch=False)

    def _forward(self, input_ids, attention_mask, labels, token_type_ids, position_ids,
                 cross, cross_mask):  # fmt: skip
        group, n = self.tp_group, self.tp_size
        top = not in_region() and n > 1
        prescaled = batch_is_shared()
        memory = self.optimize == "memory"
        ids, mask = input_ids, attention_mask
        dtype = self.position_embedding.weight.dtype
        if mask is not None:
            mask = _padding_mask(mask, dtype)
        if cross_mask is not None:
            cross_mask = _padding_mask(cross_mask, dtype)

        def group_batch(t, rows):  # this rank's rows -> the group's
            if t is not None and t.dim() > 0 and t.size(0) == rows:
                return tpf.gather_from_region(t, 0, group)
            return t

        def chunk(t, rows):  # the group's rows -> this rank's share (ids: no gradient)
            if t is not None and t.dim() > 1 and t.size(0) == rows:
                return t.chunk(n)[self.tp_rank]
            return t

        rows = input_ids.size(0)
        if cross is not None and cross_mask is not None:
            cross_mask = _TransformerRegion.mask(self, cross_mask, cross.size(0))
        if top and not prescaled:  # the group's batch: every sublayer computes on it
            ids = tpf.gather_from_region(ids, 0, group)
            labels, mask = group_batch(labels, rows), group_batch(mask, rows)
            if not memory:  # "memory" keeps this rank's own rows between sublayers
                token_type_ids = group_batch(token_type_ids, rows)
                position_ids = group_batch(position_ids, rows)
                if cross is not None:
                    cross = tpf.gather_from_region(cross, 0, group)
        if memory and top and prescaled:
            self._check_divisible(_SHARED_BATCH, ids.size(0))
            token_type_ids, position_ids = chunk(token_type_ids, rows), chunk(position_ids, rows)
            if cross is not None:
                cross = tpf.scatter_to_region(cross, 0, group)
        with _region_scope():
            partial = self.word_embedding.local(ids)
            if position_ids is None:
                position_ids = torch.arange(ids.size(1), device=ids.device)
            extra = self.position_embedding(position_ids)
            if token_type_ids is not None:
                if self.token_type_embedding is None:
                    raise ValueError(
                        "DistributedTransformerLMHead got token_type_ids but was built with "
                        "num_token_types=0"
                    )
                extra = extra + self.token_type_embedding(token_type_ids)
            if memory:  # between sublayers: this rank's chunk of the batch
                hidden = tpf.reduce_scatter(partial, 0, group)
            else:
                hidden = tpf.reduce_from_region(partial, group)
            hidden = hidden + extra
            hidden = tpf.tp_dropout(
                hidden, self.embedding_dropout_prob, self.training, self.layout.dropout_kind
            )
            hidden = self.transformer.sublayers(hidden, mask, cross, cross_mask)
            if self.layernorm is not None:
                hidden = self.layernorm(hidden)
            hidden = self.layout.enter_sublayer(hidden)  # the core batch, whole on every rank
            if not self.add_lm_head:
                out = hidden
            elif labels is None:
                logits = F.linear(hidden, self.word_embedding.weight)
                out = tpf.gather_from_region(logits, -1, group)
            else:
                logits = F.linear(hidden, self.word_embedding.weight)
                out = tpf.vocab_parallel_cross_entropy(
                    logits, labels, self.word_embedding.vocab_start, group
                )
        if top and not prescaled:
            out = tpf.scatter_to_region(out, 0, group)
        return out

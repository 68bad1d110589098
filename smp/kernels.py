"""smp's fused kernels, with autograd: the vocab-parallel cross-entropy and bias + GeLU.

Each is an op in torch's dispatcher (``torch.ops.smp.*``, include/smp/pytorch/kernels.h) with a
CPU path, the ATen composition it replaces, and a CUDA kernel in builds with CUDA
(``smp._C.built_with_cuda``). Tests hold the CUDA kernels to the CPU paths, and the CPU paths to
the plain compositions smp used before.

Which call sites use them (:func:`set_fused`):

    name             default   where
    "cross_entropy"  on        smp.nn.vocab_parallel_cross_entropy: the logits are read once
                               forward and once backward; no softmax, no [tokens, vocab] float32
                               copy is kept for backward (only the logits the caller holds).
    "bias_gelu"      off       the MLP of smp.nn's transformer layers (gelu, gelu_new): one pass
                               instead of two each way. Off until a GPU measurement shows it wins.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from smp import _C  # noqa: F401  (registers torch.ops.smp)

__all__ = ["set_fused", "fused_enabled", "vocab_cross_entropy", "bias_gelu"]

_ENABLED = {"cross_entropy": True, "bias_gelu": False}


# Shapes and dtypes of the ops' outputs, for fake tensors (FakeTensorMode: the planner's profile,
# torch.compile's tracing), which run no kernel.
@torch.library.register_fake("smp::vocab_ce_stats")
def _vocab_ce_stats_fake(logits, target, vocab_start):
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return tuple(logits.new_empty(logits.size(0), dtype=dtype) for _ in range(3))


@torch.library.register_fake("smp::vocab_ce_grad")
def _vocab_ce_grad_fake(logits, lse, target, vocab_start, grad):
    return torch.empty_like(logits)


@torch.library.register_fake("smp::bias_gelu")
def _bias_gelu_fake(x, bias, approximate):
    return torch.empty_like(x)


@torch.library.register_fake("smp::bias_gelu_backward")
def _bias_gelu_backward_fake(grad, x, bias, approximate):
    return torch.empty_like(x)


def set_fused(name: str, enabled: bool) -> None:
    """Turns one fused kernel on or off for every later call (see the module docstring)."""
    if name not in _ENABLED:
        raise ValueError(f"no fused kernel {name!r}; there are {sorted(_ENABLED)}")
    _ENABLED[name] = bool(enabled)


def fused_enabled(name: str) -> bool:
    return _ENABLED[name]


# ---- vocab-parallel cross-entropy ----------------------------------------------------------------


def _combine(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp and target logit from every rank's [3, N] (max, sum of exp, target logit),
    stacked as [ranks, 3, N]."""
    top = stats[:, 0].amax(0)
    scale = torch.exp(stats[:, 0] - top)
    total = (stats[:, 1] * scale.nan_to_num(0.0)).sum(0)
    return total.log() + top, stats[:, 2].sum(0)


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, ignore_index, gather):
        flat = logits.reshape(-1, logits.size(-1))
        tokens = target.reshape(-1)
        stats = torch.stack(torch.ops.smp.vocab_ce_stats(flat, tokens, vocab_start))
        everyone = gather(stats) if gather is not None else stats.unsqueeze(0)
        lse, picked = _combine(everyone)
        ignored = tokens == ignore_index
        loss = (lse - picked).masked_fill(ignored, 0.0)
        ctx.save_for_backward(flat, lse, tokens, ignored)
        ctx.vocab_start = vocab_start
        ctx.shape = logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad):
        flat, lse, tokens, ignored = ctx.saved_tensors
        g = grad.reshape(-1).to(lse.dtype).masked_fill(ignored, 0.0)
        dx = torch.ops.smp.vocab_ce_grad(flat, lse, tokens, ctx.vocab_start, g)
        return dx.view(ctx.shape), None, None, None, None


def vocab_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    ignore_index: int = -100,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy of logits split over the vocabulary, fused.

    ``logits`` [..., V/n] is this rank's slice (ids ``vocab_start`` onwards), any float dtype;
    ``target`` [...] holds global ids. ``gather`` maps this rank's [3, N] statistics (float32, or
    float64 for float64 logits) to every rank's, stacked [n, 3, N] (one all-gather); None when
    the vocabulary is not split. Returns [...] in the statistics' dtype, 0 where
    ``target == ignore_index``. The gradient needs no
    communication: each rank's slice of softmax - onehot is local."""
    return _VocabCrossEntropy.apply(logits, target, vocab_start, ignore_index, gather)


# ---- bias + GeLU ---------------------------------------------------------------------------------


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return torch.ops.smp.bias_gelu(x, bias, approximate)

    @staticmethod
    def backward(ctx, grad):
        x, bias = ctx.saved_tensors
        dx = torch.ops.smp.bias_gelu_backward(grad, x, bias, ctx.approximate)
        dbias = dx.reshape(-1, dx.size(-1)).sum(0, dtype=torch.float32).to(bias.dtype)
        return dx, dbias, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x + bias.to(x.dtype), approximate=approximate)`` in one pass each way."""
    return _BiasGelu.apply(x, bias, approximate)

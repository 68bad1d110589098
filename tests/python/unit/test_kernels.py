"""The fused ops' CPU paths (torch.ops.smp.*) and their autograd (smp/kernels.py) against plain
torch: the cross-entropy over a whole and a split vocabulary, bias + GeLU, and their errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from smp import kernels


def _logits(tokens=13, vocab=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=g) * 3).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[3] = -100
    return logits, target


def _split_loss(logits, target, parts):
    """Every rank's slice run through the fused op, the gather answered with all ranks' stats."""
    slices = logits.detach().chunk(parts, -1)
    starts = [sum(s.size(-1) for s in slices[:r]) for r in range(parts)]
    stats = torch.stack(
        [torch.stack(torch.ops.smp.vocab_ce_stats(s, target, b)) for s, b in zip(slices, starts)]
    )
    leaves = [s.clone().requires_grad_() for s in slices]
    losses = [
        kernels.vocab_cross_entropy(leaf, target, start, gather=lambda mine: stats)
        for leaf, start in zip(leaves, starts)
    ]
    return losses, leaves


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_vocab_cross_entropy_matches_torch(parts, dtype):
    logits, target = _logits(vocab=36, dtype=dtype)
    stats_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    full = logits.to(stats_dtype).clone().requires_grad_()
    expected = F.cross_entropy(full, target, reduction="none")
    weights = torch.linspace(0.5, 2.0, target.numel())
    (expected * weights).sum().backward()

    losses, leaves = _split_loss(logits, target, parts)
    for loss in losses:  # every rank computes every token's loss
        assert loss.dtype == stats_dtype
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, expected.detach(), **tol)
        assert loss[3] == 0  # ignore_index
    for loss in losses:
        (loss * weights).sum().backward()
    grad = torch.cat([leaf.grad for leaf in leaves], -1)
    assert grad.dtype == dtype
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(grad.to(stats_dtype), full.grad, **tol)


def test_vocab_cross_entropy_keeps_leading_dims_and_large_logits():
    logits, target = _logits(tokens=12, vocab=20)
    logits = logits.view(3, 4, 20) * 40  # exp would overflow without the max shift
    loss = kernels.vocab_cross_entropy(logits, target.view(3, 4), 0)
    expected = F.cross_entropy(logits.view(12, 20), target, reduction="none").view(3, 4)
    torch.testing.assert_close(loss, expected)


def test_fused_and_composed_cross_entropy_agree(single_process_smp):
    import smp.tp.functional as tpf

    single_process_smp()
    logits, target = _logits()
    results = []
    for fused in (True, False):
        kernels.set_fused("cross_entropy", fused)
        try:
            leaf = logits.clone().requires_grad_()
            loss = tpf.vocab_parallel_cross_entropy(leaf, target, 0)
            loss.sum().backward()
            results.append((loss.detach(), leaf.grad))
        finally:
            kernels.set_fused("cross_entropy", True)
    torch.testing.assert_close(results[0], results[1])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_gelu_matches_torch(approximate, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 24, generator=g).to(dtype)
    bias = torch.randn(24, generator=g)  # a float32 parameter, as under autocast
    x1, b1 = x.clone().requires_grad_(), bias.clone().requires_grad_()
    x2, b2 = x.clone().requires_grad_(), bias.clone().requires_grad_()
    out = kernels.bias_gelu(x1, b1, approximate)
    expected = F.gelu(x2 + b2.to(dtype), approximate=approximate)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad)
    expected.backward(grad)
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x1.grad, x2.grad)
    assert b1.grad.dtype == torch.float32
    torch.testing.assert_close(b1.grad, b2.grad, **tol)


def test_kernel_errors_name_the_argument():
    logits, target = _logits()
    with pytest.raises(RuntimeError, match=r"target must be \[13\]"):
        torch.ops.smp.vocab_ce_stats(logits, target[:5], 0)
    with pytest.raises(RuntimeError, match="target must be int64"):
        torch.ops.smp.vocab_ce_stats(logits, target.int(), 0)
    with pytest.raises(RuntimeError, match=r"logits must be \[tokens, vocab slice\]"):
        torch.ops.smp.vocab_ce_stats(logits[0], target, 0)
    with pytest.raises(RuntimeError, match="approximate must be 'none' or 'tanh', got 'fast'"):
        torch.ops.smp.bias_gelu(logits, torch.zeros(37), "fast")
    with pytest.raises(RuntimeError, match=r"bias must be \[37\]"):
        torch.ops.smp.bias_gelu(logits, torch.zeros(5), "none")
    with pytest.raises(ValueError, match="no fused kernel 'softmax'"):
        kernels.set_fused("softmax", True)


@pytest.mark.parametrize("activation", ["gelu", "gelu_new"])
def test_transformer_layer_with_fused_bias_gelu(single_process_smp, monkeypatch, activation):
    """smp.nn's transformer layer computes the same with the fused MLP activation as without."""
    smp = single_process_smp()
    calls = []
    kernel = kernels.bias_gelu
    monkeypatch.setattr(kernels, "bias_gelu", lambda *a: calls.append(a[2]) or kernel(*a))
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        layer = smp.nn.DistributedTransformerLayer(
            num_attention_heads=2,
            attention_head_size=8,
            hidden_size=16,
            intermediate_size=32,
            activation=activation,
            attention_dropout_prob=0.0,
            hidden_dropout_prob=0.0,
        )
    x = torch.randn(2, 5, 16)
    mask = torch.zeros(2, 1, 1, 5)
    results = []
    for fused in (False, True):
        kernels.set_fused("bias_gelu", fused)
        try:
            layer.zero_grad()
            out = layer((x, mask))[0]
            out.square().sum().backward()
            results.append((out.detach(), [p.grad.clone() for p in layer.parameters()]))
        finally:
            kernels.set_fused("bias_gelu", False)
    torch.testing.assert_close(results[0], results[1])
    assert calls == [{"gelu": "none", "gelu_new": "tanh"}[activation]]

"""The CUDA kernels of smp's fused ops against their CPU paths (fp32 and bf16, forward and
backward), on shapes that leave partial blocks and warps, and on a real vocabulary size."""

from __future__ import annotations

import pytest
import torch

import smp
from smp import kernels

pytestmark = pytest.mark.skipif(
    not smp._C.built_with_cuda, reason="smp was built without its CUDA sources"
)

SHAPES = [(1, 7), (33, 257), (130, 1000), (64, 50304 // 4)]


def _case(rows, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    target = torch.randint(-vocab // 4, vocab + vocab // 4, (rows,), generator=g)  # some outside
    target[0] = -100
    return logits, target


@pytest.mark.parametrize("rows,vocab", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_vocab_ce_kernels_match_cpu(rows, vocab, dtype):
    logits, target = _case(rows, vocab, dtype)
    start = vocab // 4
    cpu = torch.ops.smp.vocab_ce_stats(logits, target, start)
    gpu = torch.ops.smp.vocab_ce_stats(logits.cuda(), target.cuda(), start)
    for c, d in zip(cpu, gpu):
        assert d.is_cuda and d.dtype == c.dtype
        torch.testing.assert_close(d.cpu(), c, rtol=1e-5, atol=1e-5)
    lse = (cpu[1].log() + cpu[0]).contiguous()
    grad = torch.rand(rows, dtype=lse.dtype)
    expected = torch.ops.smp.vocab_ce_grad(logits, lse, target, start, grad)
    got = torch.ops.smp.vocab_ce_grad(logits.cuda(), lse.cuda(), target.cuda(), start, grad.cuda())
    assert got.dtype == dtype
    tol = dict(rtol=1e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.cpu(), expected, **tol)


def test_vocab_cross_entropy_autograd_on_cuda():
    logits, target = _case(48, 4096, torch.bfloat16)
    target = target.clamp(0, 4095)
    results = []
    for device in ("cpu", "cuda"):
        leaf = logits.to(device).requires_grad_()
        loss = kernels.vocab_cross_entropy(leaf, target.to(device), 0)
        loss.sum().backward()
        results.append((loss.detach().cpu(), leaf.grad.float().cpu()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("shape", [(3, 5), (4, 33, 1000), (2, 512, 4096)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_gelu_kernels_match_cpu(shape, approximate, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(dtype)
    bias = torch.randn(shape[-1], generator=g)
    grad = torch.randn(shape, generator=g).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    out = torch.ops.smp.bias_gelu(x.cuda(), bias.cuda(), approximate)
    torch.testing.assert_close(out.cpu(), torch.ops.smp.bias_gelu(x, bias, approximate), **tol)
    dx = torch.ops.smp.bias_gelu_backward(grad.cuda(), x.cuda(), bias.cuda(), approximate)
    expected = torch.ops.smp.bias_gelu_backward(grad, x, bias, approximate)
    torch.testing.assert_close(dx.cpu(), expected, **tol)


def test_kernels_follow_the_tensors_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    logits, target = _case(8, 64, torch.float32)
    stats = torch.ops.smp.vocab_ce_stats(logits.to("cuda:1"), target.to("cuda:1"), 0)
    assert all(s.device == torch.device("cuda:1") for s in stats)

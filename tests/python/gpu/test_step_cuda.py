"""A single-process smp step on the GPU against plain torch on the same GPU: loss, every
gradient, and the parameters after AdamW steps, in fp32 and under bf16 autocast."""

from __future__ import annotations

import copy

import pytest
import torch
from models import build_model, gpt_train_step, loss_fn, make_batch, parity_adamw


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_single_process_step_on_cuda_matches_torch(single_process_smp, bf16, microbatches):
    smp = single_process_smp({"microbatches": microbatches, "bf16": bf16})
    assert smp.state.get_state().device.type == "cuda"
    torch.manual_seed(0)
    reference = build_model("gpt").cuda()
    model = smp.DistributedModel(copy.deepcopy(reference).cpu())
    assert all(p.is_cuda for p in model.parameters()), "smp put the model on its GPU"
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    ref_optimizer = parity_adamw(reference.parameters())
    train_step = gpt_train_step(smp)
    tol = dict(rtol=1e-5, atol=1e-5) if not bf16 else dict(rtol=2e-2, atol=2e-3)
    for step in range(3):
        x, y = (t.cuda() for t in make_batch("gpt", 4, step))
        optimizer.zero_grad()
        loss = train_step(model, x, y).reduce_mean()
        ref_optimizer.zero_grad()
        ref_loss = 0.0
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                part = loss_fn("gpt", reference(xm), ym) / microbatches
            part.backward()
            ref_loss += part.detach()
        torch.testing.assert_close(loss.float(), ref_loss.float(), **tol)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, n=name: f"{n}: {m}")
        optimizer.step()
        ref_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **tol)

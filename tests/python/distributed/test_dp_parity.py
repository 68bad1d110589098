"""Data parallelism × microbatching equals one process running the whole global batch.

Each rank builds its model from a different seed (so the wrap-time broadcast from dp rank 0 is
what makes replicas equal) and a reference from dp rank 0's seed. Every step compares the global
loss, every gradient, and the parameters after the AdamW step. fp32, rtol = atol = 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from models import build_model, loss_fn, make_batch, parity_adamw

LOCAL_BATCH = 8
STEPS = 3
TOL = dict(rtol=1e-5, atol=1e-5)


def _parity_worker(name: str, microbatches: int, seed: int = 7) -> dict:
    import smp

    smp.init({"microbatches": microbatches})
    dp_size, dp_rank = smp.dp_size(), smp.dp_rank()
    torch.manual_seed(seed)
    reference = build_model(name)
    torch.manual_seed(seed + 101 * smp.rank())  # rank 0 matches the reference, others differ
    model = smp.DistributedModel(build_model(name))
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"{n} not broadcast from dp rank 0")
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    reference_optimizer = parity_adamw(reference.parameters())

    @smp.step
    def train_step(model, x, y):
        loss = loss_fn(name, model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for step in range(STEPS):
        x, y = make_batch(name, LOCAL_BATCH * dp_size, step)
        mine = slice(dp_rank * LOCAL_BATCH, (dp_rank + 1) * LOCAL_BATCH)

        optimizer.zero_grad()
        local_loss = train_step(model, x[mine], y[mine]).reduce_mean()
        global_loss = sum(smp.allgather(local_loss.item(), smp.DP_GROUP)) / dp_size

        reference_optimizer.zero_grad()
        reference_loss = loss_fn(name, reference(x), y)
        reference_loss.backward()

        assert abs(global_loss - reference_loss.item()) <= 1e-5 * (1 + abs(global_loss)), (
            step,
            global_loss,
            reference_loss.item(),
        )
        for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(
                p.grad, q.grad, **TOL, msg=lambda m, step=step, n=n: f"step {step} grad {n}: {m}"
            )
        optimizer.step()
        reference_optimizer.step()
        for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(
                p, q, **TOL, msg=lambda m, step=step, n=n: f"step {step} param {n}: {m}"
            )
        losses.append(global_loss)
    return {"losses": losses}


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("microbatches", [1, 4])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_data_parallel_parity(pools, name, microbatches, dp):
    results = pools.run(dp, _parity_worker, name, microbatches)
    # Every rank saw the same global losses.
    assert all(r["losses"] == results[0]["losses"] for r in results)

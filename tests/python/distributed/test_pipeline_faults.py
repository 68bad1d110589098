"""The pipeline runtime's failure modes (design.md §4j): messages that share an id, thread-local
state that must reach served calls, waits that must end, failures named by type, and runtimes
released with their model."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from models import assert_owned_grads_match
from torch import nn

TOL = dict(rtol=1e-5, atol=1e-5)


class Slow(nn.Linear):
    """A linear layer whose owner takes a while: the caller's later messages overtake it."""

    delay_s = 0.0

    def forward(self, x):
        if self.delay_s:
            time.sleep(self.delay_s)  # simulates a busy owner, not synchronisation
        return super().forward(x)


class Discards(nn.Module):
    """Stage 0 calls ``side`` on stage 1 and drops its output; ``block`` and ``head`` go on."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.block = Slow(16, 16)
        self.side = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.a(x)
        h = torch.tanh(self.block(h)) + h
        _ = self.side(h)  # discarded: its backward is only the owner's GRAD_OUT bookkeeping
        return self.head(h)


def _discards_worker(options: dict, steps: int, delay_s: float):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4} | options)
    torch.manual_seed(0)
    reference = Discards()
    torch.manual_seed(0)
    module = Discards()
    for path, stage in (("", 0), ("a", 0), ("side", 1), ("block", 1), ("head", 0)):
        smp.set_partition(module.get_submodule(path), stage)
    module.block.delay_s = delay_s
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(7)
    for step in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        optimizer.zero_grad()
        loss = train_step(model, x, y).reduce_mean()
        reference_optimizer.zero_grad()
        ref_loss = 0.0
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            mb_loss = F.cross_entropy(reference(xs), ys) / 4
            mb_loss.backward()
            ref_loss += mb_loss.item()
        assert abs(loss.item() - ref_loss) < 1e-5, (step, loss.item(), ref_loss)
        assert assert_owned_grads_match(model, reference, smp.pp_rank(), TOL) > 0
        optimizer.step()
        reference_optimizer.step()
    return steps


@pytest.mark.parametrize(
    "options,delay_s",
    [
        ({}, 0.0),
        ({}, 0.02),
        ({"pipeline_async_calls": False}, 0.0),
        ({"pipeline": "static", "pipeline_schedule": "1f1b"}, 0.02),
        ({"pipeline": "static", "pipeline_schedule": "zbh1"}, 0.0),
    ],
)
def test_a_discarded_remote_output_is_exact(pools, options, delay_s):
    """A call whose output is dropped sends GRAD_OUT as soon as the caller's backward passes it,
    which can be before the owner has taken the REQUEST off its queue: the two never collide."""
    steps = 50 if not delay_s else 10
    assert pools.run(2, _discards_worker, options, steps, delay_s, timeout_s=300) == [steps] * 2

"""With pp > 1 the first smp.step traces the model on rank 0, partitions it, and every rank ends
with the same plan; failures during tracing reach every rank."""

from __future__ import annotations

import torch
from models import build_model, loss_fn, make_batch


def _first_step_worker(name: str, pin_head: bool):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    module = build_model(name)
    if pin_head:
        smp.set_partition(module.head, 0)
    model = smp.DistributedModel(module)
    hooks = []
    model.register_post_partition_hook(lambda m, opt: hooks.append(m.partitioned))
    assert not model.partitioned

    @smp.step
    def train_step(model, x, y):
        loss = loss_fn(name, model(x), y)
        model.backward(loss)
        return loss

    x, y = make_batch(name, 4, 0)
    loss = train_step(model, x, y).reduce_mean().item()
    return model.partition_plan.assignment, loss, hooks, model.partition_report()


def test_every_rank_gets_rank_zeros_plan(pools):
    results = pools.run(2, _first_step_worker, "gpt", False)
    assignment, loss, hooks, report = results[0]
    assert results[1][0] == assignment and results[1][1] == loss  # StepOutput on every rank
    assert set(assignment.values()) == {0, 1}
    assert assignment["wte"] == assignment["lm_head"]
    assert hooks == [True]
    assert "2 stages" in report


def test_pins_hold_in_a_real_run(pools):
    results = pools.run(2, _first_step_worker, "mlp", True)
    assert results[0][0]["head"] == 0 and results[1][0] == results[0][0]


class _FailsOnRankZero(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(3, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _tracing_failure_worker():
    import smp

    smp.init({"pipeline_parallel_degree": 2})
    model = smp.DistributedModel(_FailsOnRankZero())

    @smp.step
    def forward_only(model, x):
        return model(x)

    try:
        forward_only(model, torch.randn(2, 4))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def test_tracing_failure_is_raised_on_every_rank(pools):
    messages = pools.run(2, _tracing_failure_worker)
    assert all(m and "in module 'b'" in m for m in messages), messages
    assert messages[1].startswith("StepFailedError") and "rank 0" in messages[1]

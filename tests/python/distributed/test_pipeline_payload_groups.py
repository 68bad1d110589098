"""The pipeline with its messages split as under NCCL (design.md §4.8): headers on the pipeline
group, tensors too big for the header on the payload groups (one per direction). Under NCCL the
payload groups carry the device tensors; here, on CPU-only machines, they are gloo groups that
carry the host tensors, so the same code paths (group creation, transports built with payload
groups, new payload groups after a failed step) run with exact parity checks."""

from __future__ import annotations

import torch
from models import build_model, loss_fn, make_batch, parity_adamw
from torch import nn

TOL = dict(rtol=1e-5, atol=1e-5)


def _with_payload_groups(fn, *args):
    import smp.state

    smp.state._GLOO_PAYLOAD_GROUPS = True
    try:
        return fn(*args)
    finally:
        smp.state._GLOO_PAYLOAD_GROUPS = False


def _parity_worker(pp: int, microbatches: int, tp: int = 1):
    import smp
    from smp.state import get_state

    smp.init(
        {
            "pipeline_parallel_degree": pp,
            "tensor_parallel_degree": tp,
            "microbatches": microbatches,
        }
    )
    state = get_state()
    payload = state.pipeline_payload_groups()
    assert len(payload) == 2 and payload[0] is not payload[1]
    assert state.host_group("pp") is state.groups["pp"]  # gloo: the headers' own group
    dp_size, dp_rank = smp.dp_size(), smp.dp_rank()
    torch.manual_seed(0)
    reference = build_model("gpt")
    torch.manual_seed(0)
    model = smp.DistributedModel(build_model("gpt"))
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    reference_optimizer = parity_adamw(reference.parameters())

    @smp.step
    def train_step(model, x, y):
        loss = loss_fn("gpt", model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for step in range(3):
        x, y = make_batch("gpt", 8 * dp_size, step)
        mine = slice(dp_rank * 8, (dp_rank + 1) * 8)
        optimizer.zero_grad()
        local = train_step(model, x[mine], y[mine]).reduce_mean()
        loss = sum(smp.allgather(local.item(), smp.DP_GROUP)) / dp_size
        reference_optimizer.zero_grad()
        reference_loss = loss_fn("gpt", reference(x), y)
        reference_loss.backward()
        assert abs(loss - reference_loss.item()) <= 1e-5 * (1 + abs(loss)), (loss, reference_loss)
        optimizer.step()
        reference_optimizer.step()
        losses.append(loss)
    full = model.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")
    return losses


def test_gpt_over_four_stages_with_payload_groups(pools):
    results = pools.run(4, _with_payload_groups, _parity_worker, 4, 8)
    assert all(r == results[0] for r in results)


def test_gpt_two_stages_and_data_parallelism_with_payload_groups(pools):
    results = pools.run(4, _with_payload_groups, _parity_worker, 2, 4)
    assert all(r == results[0] for r in results)


class Fails(nn.Linear):
    armed = False

    def forward(self, x):
        if self.armed:
            raise ValueError("stage 1 fails on purpose")
        return super().forward(x)


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.b = Fails(256, 256)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _failure_worker():
    """A step that fails on stage 1 while large activations are in flight, then steps that must
    equal one process: the payloads of the failed step must not reach the next ones."""
    import smp
    from smp.state import get_state

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    torch.manual_seed(0)
    module = TwoLayers()
    reference = TwoLayers()
    reference.load_state_dict(module.state_dict())
    for path, stage in (("", 0), ("a", 0), ("b", 1)):
        smp.set_partition(module.get_submodule(path), stage)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    @smp.step
    def train_step(model, x):
        out = model(x).square().mean()
        model.backward(out)
        return out

    # Microbatches of 16 x 256 floats: 16 KiB, too big for the header, so on the payload groups.
    batches = [torch.randn(64, 256, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    optimizer.zero_grad()
    train_step(model, batches[0])
    optimizer.step()
    before = get_state().pipeline_payload_groups()
    module.b.armed = True
    try:
        train_step(model, batches[1])
        failure = None
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        failure = type(exc).__name__
    module.b.armed = False
    after = get_state().pipeline_payload_groups()
    renewed = all(a is not b for a, b in zip(after, before))
    for batch in batches[2:]:
        optimizer.zero_grad()
        train_step(model, batch)
        optimizer.step()
    for batch in [batches[0], *batches[2:]]:
        reference_optimizer.zero_grad()
        reference(batch).square().mean().backward()
        reference_optimizer.step()
    full = model.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, **TOL, msg=lambda m, key=key: f"{key}: {m}")
    return failure, renewed


def test_a_failed_step_renews_the_payload_groups_and_the_next_steps_are_exact(pools):
    results = pools.run(2, _with_payload_groups, _failure_worker)
    assert results[1] == ("ValueError", True), results
    assert results[0] == ("StepFailedError", True), results

"""smp.step across ranks: failures reach every rank, unused parameters, accumulation, buffers."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from models import MLP
from torch import nn

TOL = dict(rtol=1e-5, atol=1e-5)


def _failing_step_worker(bad_rank: int, bad_microbatch: int):
    import smp

    smp.init({"microbatches": 4})
    torch.manual_seed(0)
    model = smp.DistributedModel(MLP())
    armed = [False]

    @smp.step
    def train_step(model, x):
        if armed[0] and smp.rank() == bad_rank and smp.microbatch() == bad_microbatch:
            raise KeyError("boom from the step function")
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    # One good step leaves gradients that a failed step must not disturb.
    train_step(model, torch.ones(8, 12))
    before = [p.grad.clone() for p in model.parameters()]
    armed[0] = True
    try:
        train_step(model, torch.randn(8, 12))
    except Exception as e:  # noqa: BLE001
        caught = (type(e).__name__, str(e))
    else:
        caught = None
    for p, g in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    # The world is still usable after a failed step.
    assert smp.allgather(smp.rank()) == list(range(smp.size()))
    return caught


def test_exception_on_one_rank_is_raised_on_every_rank(pools):
    results = pools.run(2, _failing_step_worker, 1, 2)
    assert results[1][0] == "KeyError" and "boom" in results[1][1]
    kind, message = results[0]
    assert kind == "StepFailedError"
    assert "rank 1, microbatch 2" in message and "boom from the step function" in message
    assert "KeyError" in message


def _killed_rank_worker():
    import smp

    smp.init({"microbatches": 2, "timeout_s": 30})
    model = smp.DistributedModel(MLP())

    @smp.step
    def train_step(model, x):
        if smp.rank() == 1:
            os._exit(17)  # a crash: no Python cleanup, no message
        loss = model(x).sum()
        model.backward(loss)
        return loss

    start = time.monotonic()
    try:
        train_step(model, torch.randn(4, 12))
    except Exception as e:  # noqa: BLE001
        return {"elapsed": time.monotonic() - start, "error": f"{type(e).__name__}: {e}"}
    return {"elapsed": time.monotonic() - start, "error": None}


def test_killed_rank_makes_the_others_fail_within_the_timeout(pools):
    outcomes = pools.run_outcomes(2, _killed_rank_worker, timeout_s=90)
    assert outcomes[1].status == "died" and outcomes[1].value == 17
    assert outcomes[0].status == "ok", outcomes[0]
    assert outcomes[0].value["error"] is not None
    assert outcomes[0].value["elapsed"] < 30 + 10


class Branchy(nn.Module):
    """Takes branch ``a`` for positive-sum inputs and ``b`` otherwise: on some ranks a parameter
    gets no gradient at all."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 3)
        self.b = nn.Linear(6, 3)
        self.never = nn.Linear(6, 3)  # used nowhere: stays without gradient everywhere

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


def _unused_worker():
    import smp

    smp.init({"microbatches": 1})
    torch.manual_seed(3)
    reference = Branchy()
    model = smp.DistributedModel(Branchy())
    model.load_state_dict(reference.state_dict())
    x = torch.stack([torch.full((6,), 1.0), torch.full((6,), -2.0)])  # rank 0 → a, rank 1 → b
    y = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0]])

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    r = smp.rank()
    train_step(model, x[r : r + 1], y[r : r + 1])
    ref_loss = sum(F.mse_loss(reference(x[i : i + 1]), y[i : i + 1]) for i in range(2)) / 2
    ref_loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, q.grad, **TOL)
    return True


def test_parameter_unused_on_one_rank_gets_the_global_mean(pools):
    pools.run(2, _unused_worker)


def _accumulation_worker(backward_passes_per_step: int):
    import smp

    smp.init({"microbatches": 2})
    torch.manual_seed(5)
    reference = MLP()
    model = smp.DistributedModel(MLP(), backward_passes_per_step=backward_passes_per_step)
    model.load_state_dict(reference.state_dict())

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    @smp.step
    def eval_step(model, x):
        return model(x)

    g = torch.Generator().manual_seed(11)
    r, n = smp.dp_rank(), smp.dp_size()
    # Three steps without zero_grad, an evaluation step in between: gradients accumulate.
    for _ in range(3):
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        train_step(model, x[r * 4 : (r + 1) * 4], y[r * 4 : (r + 1) * 4])
        out = eval_step(model, x[r * 4 : (r + 1) * 4]).concat()
        torch.testing.assert_close(out, reference(x[r * 4 : (r + 1) * 4]), **TOL)
        F.cross_entropy(reference(x), y).backward()
    if backward_passes_per_step == 2:
        # Third step opened a new window: its gradients are not reduced yet.
        return "window-open"
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    return n


def test_gradients_accumulate_across_steps_without_zero_grad(pools):
    assert pools.run(2, _accumulation_worker, 1) == [2, 2]


def _window_worker():
    import smp

    smp.init({"microbatches": 1})
    torch.manual_seed(5)
    reference = MLP()
    model = smp.DistributedModel(MLP(), backward_passes_per_step=2)
    model.load_state_dict(reference.state_dict())

    @smp.step
    def train_step(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    r = smp.dp_rank()
    xs = [torch.randn(4, 12, generator=g) for _ in range(2)]
    train_step(model, xs[0][r * 2 : r * 2 + 2])
    local_after_first = [p.grad.clone() for p in model.parameters()]
    train_step(model, xs[1][r * 2 : r * 2 + 2])
    for x in xs:
        reference(x).square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    # The first pass was not reduced: it still held this rank's own gradient.
    return [g.sum().item() for g in local_after_first]


def test_backward_passes_per_step_reduces_once_per_window(pools):
    first = pools.run(2, _window_worker)
    assert first[0] != first[1]  # local, unreduced gradients after the first pass


def _window_failure_worker():
    import smp

    smp.init({"microbatches": 2})
    torch.manual_seed(5)
    reference = MLP()
    model = smp.DistributedModel(MLP(), backward_passes_per_step=2)
    model.load_state_dict(reference.state_dict())
    fail = {"rank": None}

    @smp.step
    def train_step(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        if smp.rank() == fail["rank"] and smp.microbatch() == 1:
            raise ValueError("after two backward passes")
        return loss

    g = torch.Generator().manual_seed(1)
    r = smp.dp_rank()
    xs = [torch.randn(4, 12, generator=g) for _ in range(4)]
    train_step(model, xs[0][r * 2 : r * 2 + 2])  # pass 1 of a window
    fail["rank"] = 0
    with pytest.raises(Exception, match="after two backward passes"):
        train_step(model, xs[1][r * 2 : r * 2 + 2])  # pass 2 fails after adding gradients
    dropped = all(p.grad is None for p in model.parameters())
    fail["rank"] = None
    for x in xs[2:]:  # a new window
        train_step(model, x[r * 2 : r * 2 + 2])
        reference(x).square().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    return dropped


def test_a_failed_pass_drops_its_backward_passes_per_step_window(pools):
    # The failed pass had added to the first pass's gradients; keeping them would have mixed
    # three batches into the next reduction.
    assert pools.run(2, _window_failure_worker) == [True, True]


def _buffers_and_state_dict_worker():
    import smp

    smp.init({})
    torch.manual_seed(smp.rank())
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model = smp.DistributedModel(net)
    keys = list(model.state_dict().keys())
    mean = model.module[1].running_mean.clone()

    @smp.step
    def fwd(model, x):
        return model(x)

    model.train()
    fwd(model, torch.randn(4, 4) + smp.rank())  # running stats now differ across ranks
    fwd(model, torch.randn(4, 4))  # ...and are broadcast from dp rank 0 before this step
    return keys, mean, smp.allgather(model.module[1].num_batches_tracked.item())


def test_buffers_are_broadcast_and_state_dict_keeps_original_keys(pools):
    results = pools.run(2, _buffers_and_state_dict_worker)
    assert results[0][0] == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    torch.testing.assert_close(results[0][1], results[1][1])
    assert results[0][2] == [2, 2]


def _mismatch_worker():
    import smp

    smp.init({})
    try:
        smp.DistributedModel(nn.Linear(4, 4 + smp.rank()))
    except ValueError as e:
        return str(e)
    return None


def test_replicas_with_different_models_fail_on_every_rank(pools):
    for message in pools.run(2, _mismatch_worker):
        assert message is not None and "differs between data-parallel replicas" in message
        assert "(5, 4)" in message and "(4, 4)" in message


def _clip_worker():
    import smp

    smp.init({"microbatches": 2})
    torch.manual_seed(2)
    reference = MLP()
    model = smp.DistributedModel(MLP())
    model.load_state_dict(reference.state_dict())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, x):
        loss = model(x).square().sum()
        model.backward(loss)
        return loss

    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(0)) * 10
    r = smp.dp_rank()
    train_step(model, x[r * 4 : r * 4 + 4])
    norm = optimizer.clip_grad_norm_(0.5)
    (reference(x).square().sum() / 4).backward()  # mean over 2 microbatches x 2 ranks
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    return norm.item()


def test_clip_grad_norm_uses_the_global_norm(pools):
    norms = pools.run(2, _clip_worker)
    assert norms[0] == norms[1] and norms[0] > 0.5


def _gloo_loop_threads() -> int:
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "gloo_tcp_loop"
        except OSError:
            pass
    return count


def _fail_a_pipelined_step() -> None:
    """Runs one pipelined step that fails, keeping the error the way test code does (its
    traceback references this frame, which references the model: a reference cycle)."""
    import pytest

    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = smp.DistributedModel(MLP())

    @smp.step
    def train_step(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        raise KeyError("boom after backward")

    with pytest.raises(Exception, match="boom after backward") as caught:
        train_step(model, torch.ones(4, 12))
    assert caught.value is not None


def _shutdown_releases_groups_worker():
    import smp

    smp.shutdown()  # the pool's own leftovers, if any, out of the count
    before = _gloo_loop_threads()
    for _ in range(3):
        _fail_a_pipelined_step()
        smp.shutdown()
    return before, _gloo_loop_threads()


def test_shutdown_frees_groups_kept_alive_by_a_failed_steps_traceback(pools):
    """A destroyed gloo group keeps its connections and event-loop thread while anything
    references it; a failed step's traceback keeps the model (and so the groups) in a cycle.
    smp.shutdown() collects such cycles, so repeated init / failed step / shutdown does not
    accumulate groups (whose loops spin once their peers have closed the connections)."""
    for before, after in pools.run(2, _shutdown_releases_groups_worker):
        assert after <= before, (before, after)

"""Pipelines over dynamic models: branches, reuse, loops, bouncing calls, kwargs and dicts,
evaluation steps, and failures on a remote stage."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from models import assert_owned_grads_match, build_model
from torch import nn

TOL = dict(rtol=1e-5, atol=1e-5)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Linear(16, 16)

    def forward(self, h):
        return torch.tanh(self.c(h))


class Bouncer(nn.Module):
    """B (stage 1) calls back into C (stage 0): A on 0 → B on 1 → C on 0."""

    def __init__(self, inner: Inner):
        super().__init__()
        self.b = nn.Linear(16, 16)
        self.inner = inner

    def forward(self, h, scale: float = 1.0):
        return self.inner(self.b(h)) * scale


class Dynamic(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.bounce = Bouncer(Inner())
        self.pos = nn.Linear(16, 16)
        self.neg = nn.Linear(16, 16)
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x, *, steps: int):
        h = torch.relu(self.a(x))
        h = h + self.bounce(h, scale=0.5)  # h has a local and a remote consumer
        h = self.pos(h) if h.sum() > 0 else self.neg(h)  # data-dependent branch
        for _ in range(steps):  # trip count from the data
            h = self.shared(h) + h  # reuse
        return {"logits": self.head(h), "hidden": h}


def _place(model: Dynamic, smp) -> None:
    smp.set_partition(model.a, 0)
    smp.set_partition(model.bounce, 1)
    smp.set_partition(model.bounce.inner, 0)
    smp.set_partition(model.pos, 1)
    smp.set_partition(model.neg, 0)
    smp.set_partition(model.shared, 1)
    smp.set_partition(model.head, 0)


def _placed_dynamic(smp):
    """Dynamic (seed 0) placed by _place, as a DistributedModel."""
    torch.manual_seed(0)
    module = Dynamic()
    _place(module, smp)
    return smp.DistributedModel(module)


def _dynamic_worker(pipeline: str, microbatches: int):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": microbatches, "pipeline": pipeline})
    torch.manual_seed(0)
    reference = Dynamic()
    model = _placed_dynamic(smp)

    @smp.step
    def train_step(model, x, y):
        steps = int(x[0, 0].abs().item() * 3) % 3 + 1
        out = model(x, steps=steps)
        loss = F.cross_entropy(out["logits"], y)
        model.backward(loss)
        return loss, out["hidden"].sum()

    g = torch.Generator().manual_seed(4)
    for step in range(3):
        x = torch.randn(8, 8, generator=g) * (1 if step % 2 else -1)
        y = torch.randint(0, 3, (8,), generator=g)
        for p in model.parameters():
            p.grad = None
        loss, hidden = train_step(model, x, y)
        # Reference: the same per-microbatch computation (trip counts depend on each microbatch).
        reference.zero_grad()
        ref_loss = 0.0
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            steps = int(xs[0, 0].abs().item() * 3) % 3 + 1
            mb_loss = F.cross_entropy(reference(xs, steps=steps)["logits"], ys) / microbatches
            mb_loss.backward()
            ref_loss += mb_loss.item()
        assert abs(loss.reduce_mean().item() - ref_loss) < 1e-5
        assert_owned_grads_match(model, reference, smp.pp_rank(), TOL)
    return model.partition_plan.assignment


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_branches_reuse_loops_and_bounces(pools, pipeline, microbatches):
    assignments = pools.run(2, _dynamic_worker, pipeline, microbatches)
    assert assignments[0]["bounce.inner"] == 0 and assignments[0]["bounce"] == 1


def _leftovers_worker():
    """Per step: the worker threads in use, and the tensors left in reference cycles."""
    import gc
    import threading

    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    model = _placed_dynamic(smp)

    @smp.step
    def train_step(model, x, y):
        out = model(x, steps=2)
        loss = F.cross_entropy(out["logits"], y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(0)
    threads, cyclic = [], []
    for _ in range(4):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            train_step(model, x, y)
            gc.collect()
            cyclic.append(sum(isinstance(o, torch.Tensor) for o in gc.garbage))
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        threads.append({t.ident for t in threading.enumerate() if t.name.startswith("smp-worker")})
    return threads, cyclic


def test_steps_reuse_worker_threads_and_leave_no_cycles(pools):
    """Worker threads are kept across steps (a thread per worker churned malloc arenas: 2-4x
    torch's page faults on the benchmark), and a step's workers and calls, which reference each
    other, are released when it ends instead of waiting for the cycle collector."""
    for threads, cyclic in pools.run(2, _leftovers_worker):
        # Kept (each step's threads are still there after the next) and few: at most as many
        # as workers were alive at once (4 microbatches and the calls they have in flight).
        assert threads[0] and all(a <= b for a, b in zip(threads, threads[1:])), threads
        assert len(threads[-1]) <= 16, threads
        assert cyclic == [0, 0, 0, 0], cyclic


def _eval_worker():
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    reference = Dynamic()
    model = _placed_dynamic(smp)

    @smp.step
    def evaluate(model, x):
        return model(x, steps=2)["logits"]

    x = torch.randn(4, 8)
    with torch.no_grad():
        out = evaluate(model, x).concat()
        expected = torch.cat([reference(xs, steps=2)["logits"] for xs in x.chunk(2)])
    torch.testing.assert_close(out, expected, **TOL)
    assert all(p.grad is None for p in model.parameters())
    return True


def test_evaluation_step_pipelines_and_reaches_every_rank(pools):
    assert pools.run(2, _eval_worker) == [True, True]


class Failing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _two_stage_failing(smp, timeout_s: float, hook):
    """smp on 2 stages with Failing's ``a`` on stage 0 and ``b`` (running ``hook`` before its
    forward) on stage 1; returns (module, model, train_step)."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": timeout_s})
    torch.manual_seed(0)
    module = Failing()
    smp.set_partition(module.a, 0)
    smp.set_partition(module.b, 1)
    model = smp.DistributedModel(module)
    module.b.register_forward_pre_hook(hook)

    @smp.step
    def train_step(model, x):
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    return module, model, train_step


def _failure_and_seconds(run) -> tuple[str | None, float]:
    """Runs ``run()``; returns ("Type: message" of what it raised or None, seconds it took)."""
    start = time.monotonic()
    try:
        run()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return None, time.monotonic() - start


def _remote_failure_worker():
    import smp

    def explode(mod, args):
        if smp.microbatch() == 1:
            raise ValueError("bad activations in b")

    _, model, train_step = _two_stage_failing(smp, 60, explode)
    return _failure_and_seconds(lambda: train_step(model, torch.randn(4, 4)))


def test_exception_on_stage_one_reaches_rank_zero(pools):
    results = pools.run(2, _remote_failure_worker)
    for message, elapsed in results:
        assert message is not None and "bad activations in b" in message, message
        assert elapsed < 30
    assert "stage 1" in results[0][0] and "microbatch 1" in results[0][0]
    assert "module 'b'" in results[0][0]


def _killed_stage_worker():
    import smp

    armed = [False]

    def die(mod, args):
        if armed[0]:
            os._exit(9)

    _, model, train_step = _two_stage_failing(smp, 20, die)
    train_step(model, torch.randn(4, 4))  # partitions (tracing runs b on rank 0) and trains
    armed[0] = True
    return _failure_and_seconds(lambda: train_step(model, torch.randn(4, 4)))


def test_killed_stage_makes_the_leader_fail_within_the_timeout(pools):
    outcomes = pools.run_outcomes(2, _killed_stage_worker, timeout_s=120)
    assert outcomes[1].status == "died"
    assert outcomes[0].status == "ok", outcomes[0]
    message, elapsed = outcomes[0].value
    assert message is not None and elapsed < 20 + 15, outcomes[0].value


def _recovery_worker():
    import smp

    armed = [False]

    def explode(mod, args):
        if armed[0]:
            raise ValueError("transient")

    torch.manual_seed(0)
    reference = Failing()
    module, model, train_step = _two_stage_failing(smp, 60, explode)
    x = torch.randn(4, 4)
    train_step(model, x)  # partitions
    armed[0] = True
    with pytest.raises(Exception, match="transient"):
        train_step(model, x)
    armed[0] = False
    for p in model.parameters():
        p.grad = None
    loss = train_step(model, x).reduce_mean()  # the next step works and is exact
    ref = sum(reference(xs).square().mean() for xs in x.chunk(2)) / 2
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-6
    if smp.pp_rank() == 1:
        torch.testing.assert_close(module.b.weight.grad, reference.b.weight.grad, **TOL)
    return True


def test_a_failed_step_leaves_the_pipeline_usable(pools):
    assert pools.run(2, _recovery_worker) == [True, True]


def _varying_lengths_worker(pipeline: str):
    from model import lm_loss

    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": pipeline})
    torch.manual_seed(0)
    reference = build_model("gpt")
    torch.manual_seed(0)
    model = smp.DistributedModel(build_model("gpt"))

    @smp.step(non_split_inputs=["sequences"])
    def train_step(model, sequences):
        ids = sequences[smp.microbatch()]  # a different length in every microbatch and step
        loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(2)
    for lengths in [(5, 9), (17, 3), (12, 12)]:
        sequences = [torch.randint(0, 64, (2, n), generator=g) for n in lengths]
        for p in model.parameters():
            p.grad = None
        reference.zero_grad()
        loss = train_step(model, sequences).reduce_mean()
        ref = sum(lm_loss(reference(s[:, :-1]), s[:, 1:]) for s in sequences) / 2
        ref.backward()
        assert abs(loss.item() - ref.item()) < 1e-5
        assert_owned_grads_match(model, reference, smp.pp_rank(), TOL)
    return True


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_sequence_length_varies_across_microbatches_and_steps(pools, pipeline):
    assert pools.run(2, _varying_lengths_worker, pipeline) == [True, True]

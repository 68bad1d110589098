"""The pipeline runtime's failure modes (design.md §4.7): messages that share an id, thread-local
state that must reach served calls, waits that must end, failures named by type, and runtimes
released with their model."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from models import exact_steps
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

    def place(module):
        for path, stage in (("", 0), ("a", 0), ("side", 1), ("block", 1), ("head", 0)):
            smp.set_partition(module.get_submodule(path), stage)
        module.block.delay_s = delay_s

    exact_steps(smp, Discards, place, [0] * steps, 7, 4, lambda *_: None, lambda _: None)
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


class Mixed(nn.Module):
    """Linear layers (autocast lowers them), a LayerNorm and a softmax on both stages."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.norm(self.a(x))
        h = torch.softmax(self.b(h), dim=-1)
        return self.head(self.c(h) + h.float())


def _dtype_hooks(module: nn.Module, seen: dict) -> None:
    for path, sub in module.named_modules():
        if path:
            sub.register_forward_hook(
                lambda m, args, out, path=path: seen.setdefault(path, set()).add(str(out.dtype))
            )


def _autocast_worker(where: str):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    reference = Mixed()
    torch.manual_seed(0)
    module = Mixed()
    for path, stage in (("", 0), ("a", 0), ("norm", 1), ("b", 1), ("c", 0), ("head", 1)):
        smp.set_partition(module.get_submodule(path), stage)
    seen, expected = {}, {}
    _dtype_hooks(module, seen)
    _dtype_hooks(reference, expected)
    model = smp.DistributedModel(module)
    packed = [0]

    def pack(t):
        packed[0] += 1
        return t

    def bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    @smp.step
    def train_step(model, x, y):
        with bf16() if where == "inside" else contextlib.nullcontext():
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        model.backward(loss)
        return loss

    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    # What the step's thread sets around the step reaches every forward, on every stage.
    outside = bf16() if where == "outside" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), outside:
        loss = train_step(model, x, y).reduce_mean()
    with bf16():
        ref_loss = F.cross_entropy(reference(x).float(), y)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    plan = model.partition_plan
    owned = {p for p in expected if plan.assignment[p] == smp.pp_rank()}
    assert {p: seen[p] for p in owned} == {p: expected[p] for p in owned}, (seen, expected)
    assert packed[0] > 0  # saved-tensor hooks ran on this rank's forwards
    return sorted(owned)


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_autocast_and_saved_tensor_hooks_reach_every_stage(pools, where):
    """``torch.autocast`` around the model call (inside the step function) or around the step,
    and saved-tensor hooks around the step: every module sees what it would in one process."""
    owned = pools.run(2, _autocast_worker, where)
    assert sorted(owned[0] + owned[1]) == ["a", "b", "c", "head", "norm"]


class SaysTimedOut(nn.Linear):
    armed = False

    def forward(self, x):
        if self.armed:
            raise ValueError("gloo: connection timed out, transport aborted (nccl)")
        return super().forward(x)


class Hangs(nn.Linear):
    """Waits for ``release`` when armed: a forward that hangs (a lock never freed, say)."""

    armed = False
    release = threading.Event()

    def forward(self, x):
        if self.armed:
            type(self).release.wait(60)
        return super().forward(x)


class TwoLayers(nn.Module):
    """``a`` on stage 0, then ``b`` (of class ``second``) on stage 1."""

    def __init__(self, second: type[nn.Linear]):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = second(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _armed(smp, second: type[nn.Linear], config: dict):
    """A pipelined TwoLayers after one good step, and its step function; arm ``module.b``."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2} | config)
    module = TwoLayers(second)
    for path, stage in (("", 0), ("a", 0), ("b", 1)):
        smp.set_partition(module.get_submodule(path), stage)
    model = smp.DistributedModel(module)

    @smp.step
    def train_step(model, x):
        out = model(x).sum()
        model.backward(out)
        return out

    def step():
        return train_step(model, torch.randn(4, 4))

    step()
    return module, step


def _user_error_worker():
    import smp

    module, step = _armed(smp, SaysTimedOut, {})
    module.b.armed = True
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return type(exc).__name__, str(exc).splitlines()[0]
    return None


def test_a_user_error_is_the_cause_whatever_its_words(pools):
    """An error of the model's own code whose text reads like a communication failure is still
    the cause: stage 1 raises it, stage 0 (which saw only that stage 1 failed) names stage 1."""
    (kind0, text0), (kind1, text1) = pools.run(2, _user_error_worker)
    assert kind1 == "ValueError", (kind1, text1)
    assert kind0 == "StepFailedError", (kind0, text0)
    assert text0.startswith("smp.step failed on rank 1"), text0
    assert "ValueError: gloo: connection timed out" in text0, text0


def _hang_worker():
    import smp

    module, step = _armed(smp, Hangs, {"timeout_s": 3})
    module.b.armed = True
    start = time.monotonic()
    try:
        step()
        failure = None
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        failure = str(exc).splitlines()[0]
    took = time.monotonic() - start
    Hangs.release.set()  # the hung forward returns; its worker must not disturb what follows
    module.b.armed = False
    for _ in range(3):
        step()
    return failure, took


def test_a_hung_forward_fails_the_step_in_bounded_time_and_names_it(pools):
    """The server waits 2 x timeout_s at most for a worker to give the baton back (the worker's
    own waits, up to timeout_s, fail first when they are the cause); the error names the
    stage, the microbatch and the module, every rank fails, and the next steps run (the hung
    worker, once released, ends without sending anything)."""
    (failure0, took0), (failure1, took1) = pools.run(2, _hang_worker, timeout_s=120)
    wanted = "stage 1 waited 6 s (2 x timeout_s) for microbatch 0's call of module 'b'"
    assert wanted in failure1, failure1
    assert failure0.startswith("smp.step failed on rank 1"), failure0
    assert "module 'b'" in failure0, failure0
    assert max(took0, took1) < 2 * 3 + 10, (took0, took1)


def _native_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def _release_worker():
    import gc
    import weakref

    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    counts, refs = [], []
    for _ in range(4):
        module = Discards()
        for path, stage in (("", 0), ("a", 0), ("side", 1), ("block", 1), ("head", 0)):
            smp.set_partition(module.get_submodule(path), stage)
        model = smp.DistributedModel(module)
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(2):
            optimizer.zero_grad()
            train_step(model, torch.randn(8, 8), torch.randint(0, 3, (8,)))
            optimizer.step()
        refs.append(weakref.ref(model._runtime))
        del model, optimizer, module
        gc.collect()
        smp.barrier()  # both ranks have dropped the model before either counts
        counts.append(_native_threads())
    workers = [t for t in threading.enumerate() if t.name.startswith("smp-")]
    for t in workers:
        t.join(10)
    return [r() is None for r in refs], counts, [t.name for t in workers if t.is_alive()]


def test_a_dropped_pipelined_model_releases_its_runtime_threads_and_transports(pools):
    """Four pipelined models made, trained and dropped in turn: each one's runtime is collected
    with it, and the process's threads (worker pool, transport receivers) do not grow."""
    for released, counts, alive in pools.run(2, _release_worker):
        assert all(released), released
        assert counts[-1] == counts[0], counts
        assert not alive, alive


class TakesACount(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, count: int):
        return self.fc(x) * (1.0 + 0.01 * (count % 3))


class PassesCounts(nn.Module):
    """Every step calls stage 1 with a Python int never seen before: a new call-structure key."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = TakesACount()
        self.head = nn.Linear(8, 3)

    def forward(self, x, count: int):
        return self.head(self.b(self.a(x), count))


def _cache_worker(limit: int, steps: int):
    import smp
    from smp.pipeline import cache

    default, cache.CALL_CACHE_SIZE = cache.CALL_CACHE_SIZE, limit
    try:
        return _train_passing_counts(smp, steps)
    finally:
        cache.CALL_CACHE_SIZE = default  # the pool's process runs other tests next


def _train_passing_counts(smp, steps: int) -> str:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    reference = PassesCounts()
    torch.manual_seed(0)
    module = PassesCounts()
    for path, stage in (("", 0), ("a", 0), ("b", 1), ("head", 0)):
        smp.set_partition(module.get_submodule(path), stage)
    model = smp.DistributedModel(module)

    @smp.step(non_split_inputs=["count"])
    def train_step(model, x, y, count):
        loss = F.cross_entropy(model(x, count), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        loss = train_step(model, x, y, step).reduce_mean()
        ref = sum(
            F.cross_entropy(reference(xs, step), ys) for xs, ys in zip(x.chunk(2), y.chunk(2))
        )
        torch.testing.assert_close(loss, ref / 2, **TOL)
    return smp.last_step_timeline().summary()


def test_call_structure_caches_are_bounded_and_reported(pools):
    """A model whose calls carry a new Python value every step made the runtime's tables grow
    with the steps; they hold at most their limit, and the timeline's summary says so."""
    summary = pools.run(2, _cache_worker, 4, 12)[0]
    caches = "call caches: predictions 4, push_outputs 4, unstable 0, argument_reads 4 (limit 4"
    assert caches in summary, summary


class Jitter(nn.Module):
    """Takes a different time at each call (its own Python random, seeded per run): the order of
    the stages' tasks changes from run to run, as it does with real timing noise."""

    def __init__(self, seed: int):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.timing = __import__("random").Random(seed)

    def forward(self, x):
        time.sleep(self.timing.uniform(0, 0.01))
        return self.fc(x)


class Drops(nn.Module):
    """Dropout on both stages, before and after calls that take varying time."""

    def __init__(self, seed: int):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.drop_a = nn.Dropout(0.5)
        self.slow = Jitter(seed)
        self.drop_b = nn.Dropout(0.5)
        self.drop_c = nn.Dropout(0.5)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.drop_a(self.a(x))
        h = self.drop_b(self.slow(h))
        # Back on stage 0, after waiting for stage 1: when this runs depends on timing.
        return self.head(self.drop_c(torch.relu(h)))


def _dropout_worker(runs: int) -> list:
    import smp

    losses = []
    for run in range(runs):
        smp.init({"pipeline_parallel_degree": 2, "microbatches": 8, "active_microbatches": 3})
        torch.manual_seed(0)
        module = Drops(seed=run)
        for path, stage in (("", 0), ("a", 0), ("drop_a", 0), ("slow", 1), ("drop_b", 1)):
            smp.set_partition(module.get_submodule(path), stage)
        smp.set_partition(module.head, 0)
        smp.set_partition(module.drop_c, 0)
        model = smp.DistributedModel(module)

        @smp.step
        def train_step(model, x, y):
            loss = F.cross_entropy(model(x), y)
            model.backward(loss)
            return loss

        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        step_losses = [train_step(model, x, y).reduce_mean().item() for _ in range(2)]
        grads = [p.grad.clone() for p in model.local_parameters() if p.grad is not None]
        losses.append((step_losses, torch.cat([g.flatten() for g in grads]).tolist()))
        smp.shutdown()
    return losses


def test_dropout_in_a_pipelined_step_draws_the_same_numbers_whatever_the_timing(pools):
    """Three runs of the same seeded job whose stages' tasks interleave differently give bitwise
    the same losses: each worker draws from a stream of its own. The gradients are the same
    masks' gradients, summed over the microbatches in the order their backward tasks finish,
    which timing decides: equal up to the order of a float sum (a wrong mask would differ by
    far more)."""
    for per_run in pools.run(2, _dropout_worker, 3, timeout_s=300):
        assert per_run[0][0] == per_run[1][0] == per_run[2][0], [run[0] for run in per_run]
        for run in per_run[1:]:
            torch.testing.assert_close(
                torch.tensor(run[1]), torch.tensor(per_run[0][1]), rtol=1e-6, atol=1e-7
            )

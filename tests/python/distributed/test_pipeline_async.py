"""Asynchronous cross-stage calls (design.md §4.3): chained calls to one stage run without round
trips, outputs used on the caller, passed on by reference, or both give exact gradients, a step
whose calls change is still exact, and a module whose output structure changes makes smp run
the step again, exactly, with that module's calls waiting (or, when the step cannot be undone,
fails it clearly). Calls whose REPLY and GRAD_IN would say nothing new are quiet, and each
way such a call can go otherwise runs the step again, exactly."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from models import assert_owned_grads_match, exact_steps
from torch import nn

TOL = dict(rtol=1e-5, atol=1e-5)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h):
        return torch.tanh(self.fc(h)) + h


class Chain(nn.Module):
    """``a`` and ``head`` on stage 0, four blocks on stage 1. ``variant`` changes the calls."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 3)
        self.variant = 0

    def forward(self, x):
        h = self.a(x)
        if self.variant == 1:  # a different sequence of calls: one block skipped, a reuse
            h = self.blocks[0](h)
            h1 = self.blocks[1](h)
            # h1 has a consumer on its own stage (by reference) and one here (materialized)
            h = self.blocks[3](h1) + 0.5 * h1
            h = self.blocks[3](h)
        else:
            for block in self.blocks:
                h = block(h)
        return self.head(h)


def _place(model: Chain, smp) -> None:
    # The root too: by crossings alone it would go to stage 1 with the blocks (its calls to
    # ``a`` and ``head`` cross, its four block calls not), and this test is about the leader's
    # calls to a chain of blocks on another stage.
    smp.set_partition(model, 0)
    smp.set_partition(model.a, 0)
    smp.set_partition(model.head, 0)
    for block in model.blocks:
        smp.set_partition(block, 1)


def _chain_worker(options: dict, microbatches: int):
    import smp
    from smp.pipeline import runtime, workers

    smp.init({"pipeline_parallel_degree": 2, "microbatches": microbatches} | options)
    waits, fetches, direct = [0], [0], [0]
    wait_for = workers._Worker.wait_for
    await_values = runtime.PipelineRuntime._await_values

    def counting_wait_for(self, call):
        waits[0] += 1
        resumes = self.resumes
        wait_for(self, call)
        direct[0] += self.resumes - resumes  # took its REPLY itself (Note [Direct resumes])

    def counting_await_values(self, call):
        fetches[0] += not call.push and call.fetch is None
        return await_values(self, call)

    workers._Worker.wait_for = counting_wait_for
    runtime.PipelineRuntime._await_values = counting_await_values
    try:
        per_step = exact_steps(
            smp, Chain, lambda m: _place(m, smp), [0, 0, 1, 0, 1], 3, microbatches,
            lambda step, module: waits.__setitem__(0, 0) or fetches.__setitem__(0, 0)
            or direct.__setitem__(0, 0),
            lambda step: (waits[0], fetches[0], direct[0]),
        )  # fmt: skip
        return [c[0] for c in per_step], [c[1] for c in per_step], [c[2] for c in per_step]
    finally:
        workers._Worker.wait_for = wait_for
        runtime.PipelineRuntime._await_values = await_values


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"pipeline_async_calls": False},
        {"pipeline": "static", "pipeline_schedule": "1f1b"},  # the calls change in step 3
        {"pipeline": "static", "pipeline_schedule": "zbh1"},
    ],
)
def test_chain_and_changing_calls_are_exact(pools, options):
    waits, fetches, direct = pools.run(2, _chain_worker, options, 4)[0]  # the leader's
    # A wait ends with the worker taking its own REPLY (Note [Direct resumes]) only when that
    # is the server's next task; with four microbatches another's task mostly comes first.
    assert all(d <= w for d, w in zip(direct, waits)), (direct, waits)
    if options.get("pipeline_async_calls", True):
        # Step 1 repeats step 0's calls: every block call returns at once, and each microbatch
        # waits once, for the last block's output (the head is on this stage).
        assert waits[1] == 4, waits
        assert waits[3] == 4, waits  # after a step with other calls, as fast again
        # Outputs passed on by reference in steps 0-1 are not sent back; in step 2 one of them
        # (h1) is used on the leader and fetched, in some microbatch at least.
        assert fetches[1] == 0 and fetches[2] > 0, fetches
    else:
        assert waits[1] == 4 * 4, waits  # one round trip per block call
        assert not any(fetches), fetches


def test_a_lone_waiting_worker_takes_its_replies_itself(pools):
    """One microbatch, every call waited for: nothing else can come first, so each REPLY is
    taken by the worker waiting for it, with no hand-off to the loop (Note [Direct resumes]),
    and the steps stay exact."""
    waits, _, direct = pools.run(2, _chain_worker, {"pipeline_async_calls": False}, 1)[0]
    assert waits[1] == 4 and direct == waits, (waits, direct)


class Flaky(nn.Module):
    """Returns (h,) until ``extra`` is set, then (h, h.sum()): same arguments, new structure.
    Once ``call_out`` is set it also calls ``helper`` (placed on another stage by some tests):
    same arguments and structure, but a call of another stage. Once ``use_skip`` is set it adds
    ``skip`` (which needs a gradient): a gradient for an argument that had got none.
    Its batch norm's running statistics change at every call in training mode, and so does
    ``calls`` once ``count`` is set."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.helper = nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.extra = self.count = self.call_out = self.use_skip = False

    def forward(self, h, skip=None):
        h = self.bn(self.fc(h))
        if self.call_out:
            h = h + self.helper(h)
        if self.use_skip:
            h = h + skip
        if self.count:
            self.calls += 1
        return (h, h.sum()) if self.extra else (h,)


class UsesFlaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.flaky = Flaky()
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.flaky(self.a(x))[0])


class UsesFlakyInAChain(UsesFlaky):
    """``flaky`` between two blocks of its stage: its input comes from there, its outputs stay
    there, and its other argument (``skip``, from the leader's stage) gets no gradient while
    it ignores it, so once the leader has learned all that, its calls are quiet (Note [Quiet
    calls] in smp/pipeline/protocol.py): its stage sends no REPLY and no GRAD_IN for them. The
    root calls ``flaky.helper`` (so that the partitioner places it where it is pinned)."""

    def __init__(self):
        super().__init__()
        self.pre, self.post = Block(), Block()

    def forward(self, x):
        skip = self.flaky.helper(self.a(x))
        return self.head(self.post(self.flaky(self.pre(skip), skip)[0]))


def _flaky_models(smp, kind: str = "pushed"):
    make = UsesFlaky if kind == "pushed" else UsesFlakyInAChain
    torch.manual_seed(0)
    reference = make()
    torch.manual_seed(0)
    module = make()
    if kind != "pushed":  # the root too: else the stage-1 root (by crossings) calls flaky
        smp.set_partition(module, 0)
    smp.set_partition(module.a, 0)
    smp.set_partition(module.head, 0)
    for name, child in module.named_children():
        if name not in ("a", "head"):
            smp.set_partition(child, 1)
    smp.set_partition(module.flaky.helper, 1 if kind == "pushed" else 0)
    return module, reference, smp.DistributedModel(module)


def _structure_worker(kind: str):
    import smp
    from smp.pipeline import protocol, runtime, workers

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 60})
    module, reference, model = _flaky_models(smp, kind)
    with _count_sent(runtime, 1, 0, (protocol.REPLY, protocol.GRAD_IN)) as replies:
        return _structure_steps(smp, workers, module, reference, model, kind, replies)


def _structure_steps(smp, workers, module, reference, model, kind, replies):
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    @smp.step
    def train_step(model, x, y):
        draw = torch.rand(())  # the microbatch's stream: a rerun must draw the same numbers
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss, draw

    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))]
    # With flaky's outputs left on its stage, its calls are quiet from step 2 (step 1 learns
    # that the leader does not use them): the change comes a step later there.
    at = 2 if kind == "pushed" else 3
    batches *= at + 2
    reruns, replied = [], []
    for step, (x, y) in enumerate(batches):
        # Step 2 changes flaky's output structure (or makes it call the leader's stage): the
        # leader had continued with the old one (or not waited for its end).
        change = {"calls_out": "call_out", "grads_back": "use_skip"}.get(kind, "extra")
        setattr(module.flaky, change, step >= at)
        setattr(reference.flaky, change, step >= at)
        replies[:] = [0, 0]
        module.flaky.count = reference.flaky.count = step >= 1  # saved from step 2 on
        torch.manual_seed(100 + step)
        optimizer.zero_grad()
        loss, draws = train_step(model, x, y)
        reruns.append(model._runtime.reruns)
        replied.append(tuple(replies))
        # Each microbatch draws from its own stream, keyed by one draw of the leader's
        # generator per step (design.md §4.7); a rerun restores the generator first.
        torch.manual_seed(100 + step)
        base = int(torch.randint(0, workers._MASK, (), dtype=torch.int64))
        streams = [torch.Generator().manual_seed(workers._mix(base, mb)) for mb in range(2)]
        expected = [torch.rand((), generator=stream) for stream in streams]
        ref_optimizer.zero_grad()
        ref_loss = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            mb_loss = F.cross_entropy(reference(xs), ys) / 2
            mb_loss.backward()
            ref_loss += mb_loss.item()
        if smp.pp_rank() == 0:
            assert [d.item() for d in draws] == [e.item() for e in expected], (step, draws)
        assert abs(loss.reduce_mean().item() - ref_loss) < 1e-5, step
        assert_owned_grads_match(model, reference, smp.pp_rank(), TOL)
        optimizer.step()
        ref_optimizer.step()
    if smp.pp_rank() == 1:  # restored before the rerun: updated once per microbatch served
        buffers = dict(reference.flaky.named_buffers())
        for name, buffer in module.flaky.named_buffers():  # bn's statistics and ``calls``
            torch.testing.assert_close(buffer, buffers[name], **TOL, msg=name)
    for (n, p), q in zip(model.module.named_parameters(), reference.parameters()):
        if model.partition_plan.assignment[n.rpartition(".")[0]] == smp.pp_rank():
            torch.testing.assert_close(p, q, **TOL)
    return reruns, replied


@contextlib.contextmanager
def _count_sent(runtime, stage: int, peer: int, kinds: tuple[int, ...]):
    """Counts the messages of each of ``kinds`` that stage ``stage`` hands its sender for
    ``peer``."""
    import smp

    count = [0] * len(kinds)
    send = runtime.Sender.send

    def counting_send(self, to, header, tensors, wait=False):
        if smp.pp_rank() == stage and to == peer and header[0] in kinds:
            count[kinds.index(header[0])] += 1
        return send(self, to, header, tensors, wait)

    runtime.Sender.send = counting_send
    try:
        yield count
    finally:
        runtime.Sender.send = send


@pytest.mark.parametrize("kind", ["pushed", "quiet", "calls_out", "grads_back"])
def test_changed_output_structure_runs_the_step_again_exactly(pools, kind):
    # Every rank ran the step of the change twice, and the next once: flaky's calls wait (or
    # are answered) from then on.
    (reruns, _), (other, replied) = pools.run(2, _structure_worker, kind)  # stage 1 replies
    # (REPLYs, GRAD_INs) from stage 1 per step
    if kind == "pushed":  # every call of a stage-1 module is answered
        assert reruns == other == [0, 0, 1, 1], (reruns, other)
        assert replied[:2] == [(2, 2)] * 2 and replied[3] == (2, 2), replied
    else:
        assert reruns == other == [0, 0, 0, 1, 1], (reruns, other)
        # pre, flaky and post, per microbatch, until flaky's calls are quiet (step 2); then
        # only pre (whose input needs its gradient back) and post (whose outputs the leader
        # uses); after the change flaky's calls are answered again.
        assert [replied[i] for i in (0, 2, 4)] == [(6, 6), (4, 4), (6, 6)], replied


def _unsaved_buffer_worker():
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 60})
    module, reference, model = _flaky_models(smp)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    @smp.step
    def evaluate(model, x):
        return model(x)

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    model.eval()
    evaluate(model, x)
    model.train()
    module.flaky.extra = reference.flaky.extra = True
    module.flaky.count = reference.flaky.count = True
    with pytest.raises(RuntimeError) as info:
        train_step(model, x, y)  # ``calls`` changes for the first time: nothing saved it
    assert all(p.grad is None for p in model.parameters())
    # The module's calls wait now, and ``calls`` is saved from now on: the next step is exact
    # (the reference runs its microbatches once in each mode, like the failed step).
    loss = train_step(model, x, y).reduce_mean()
    reference.eval()
    reference(x)
    reference.train()
    for xs in x.chunk(2):
        reference(xs)
    ref_loss = 0.0
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        mb_loss = F.cross_entropy(reference(xs), ys) / 2
        mb_loss.backward()
        ref_loss += mb_loss.item()
    assert abs(loss.item() - ref_loss) < 1e-5
    assert_owned_grads_match(model, reference, smp.pp_rank(), TOL)
    return str(info.value)


def test_changed_output_structure_fails_when_the_step_cannot_run_again(pools):
    leader, other = pools.run(2, _unsaved_buffer_worker)
    for message in (leader, other):
        assert "module 'flaky'" in message, message
        assert "tuple(Tensor, Tensor)" in message and "tuple(Tensor)" in message, message
    assert "could not run again" in leader and "buffer 'flaky.calls'" in leader, leader
    assert "changed during the step for the first time" in leader, leader


class FourStages(nn.Module):
    """``a`` and ``head`` on stage 0, ``b1`` and ``b4`` on stage 1, ``b2`` on 2, ``b3`` on 3.

    Variant 0 is a chain whose activations go 1 -> 2 -> 3 -> 1 -> 0; in variant 1 the output of
    ``b1`` has consumers on stage 2, on its own stage (by reference) and on the leader."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b1, self.b2, self.b3, self.b4 = (Block() for _ in range(4))
        self.head = nn.Linear(16, 3)
        self.variant = 0

    def forward(self, x):
        h = self.a(x)
        if self.variant == 0:
            return self.head(self.b4(self.b3(self.b2(self.b1(h)))))
        u = self.b1(h)
        v = self.b2(u)
        z = self.b3(self.b4(u))
        return self.head(u + v + z)


def _four_stage_worker(microbatches: int):
    import smp
    from smp.pipeline import protocol, runtime, workers

    smp.init({"pipeline_parallel_degree": 4, "microbatches": microbatches, "timeout_s": 60})
    counts = {"waits": 0, "fetches": 0, "peer_inputs": 0, "overtaken": 0}
    hold = [False]
    held: dict[int, tuple] = {}
    fetched: set[int] = set()
    saved = (
        workers._Worker.wait_for,
        runtime.PipelineRuntime._await_values,
        runtime.PipelineRuntime._peer_input_arrived,
        runtime.PipelineRuntime._serve,
    )
    wait_for, await_values, peer_input_arrived, serve = saved

    def counting_wait_for(self, call):
        counts["waits"] += 1
        return wait_for(self, call)

    def counting_await_values(self, call):
        counts["fetches"] += not call.push and call.fetch is None
        return await_values(self, call)

    def counting_peer_input_arrived(self, fetch, message):
        counts["peer_inputs"] += 1
        return peer_input_arrived(self, fetch, message)

    def reordering_serve(self, worker_id, peer, header, tensors):
        # While ``hold`` is set, stage 1 takes each of the leader's REQUESTs for b1 only after
        # stage 2's FETCH of its outputs: the FETCH overtakes the REQUEST, every time.
        if hold[0] and peer == 0 and header[3] == self.index_of["b1"]:
            if header[2] not in fetched:
                held[header[2]] = (worker_id, peer, header, tensors)
                return
            counts["overtaken"] += 1
        serve(self, worker_id, peer, header, tensors)
        if hold[0] and header[3] == protocol._FETCH and header[8] == 0:
            fetched.add(header[9])
            if header[9] in held:
                counts["overtaken"] += 1
                serve(self, *held.pop(header[9]))

    workers._Worker.wait_for = counting_wait_for
    runtime.PipelineRuntime._await_values = counting_await_values
    runtime.PipelineRuntime._peer_input_arrived = counting_peer_input_arrived
    runtime.PipelineRuntime._serve = reordering_serve

    def place(module):
        for name, stage in [("a", 0), ("head", 0), ("b1", 1), ("b4", 1), ("b2", 2), ("b3", 3)]:
            smp.set_partition(getattr(module, name), stage)

    def before_step(step, module):
        hold[0] = step == 2 and smp.pp_rank() == 1
        counts.update(waits=0, fetches=0, peer_inputs=0, overtaken=0)

    try:
        per_step = exact_steps(
            smp, FourStages, place, [0, 0, 0, 1, 1, 0], 7, microbatches, before_step,
            lambda step: dict(counts),
        )  # fmt: skip
        assert not held
        return per_step
    finally:
        (
            workers._Worker.wait_for,
            runtime.PipelineRuntime._await_values,
            runtime.PipelineRuntime._peer_input_arrived,
            runtime.PipelineRuntime._serve,
        ) = saved


def test_outputs_go_straight_to_the_stage_that_consumes_them(pools):
    m = 4
    per_rank = pools.run(4, _four_stage_worker, m)
    leader, stage1, stage2, stage3 = per_rank
    # Step 1 repeats step 0's calls: the leader waits once per microbatch (for b4's output, which
    # the head needs) and fetches nothing; each block's input comes from the stage before it.
    assert leader[1]["waits"] == m and leader[1]["fetches"] == 0, leader
    assert [s[1]["peer_inputs"] for s in (stage1, stage2, stage3)] == [m, m, m], per_rank
    # Step 2: every FETCH of b1's outputs reached stage 1 before the REQUEST that computes them.
    assert stage1[2]["overtaken"] == m, stage1
    # Variant 1 (steps 3, 4): b1's output goes to stage 2 directly and b4 by reference; after
    # step 3 the leader fetches it only because it uses it itself.
    assert stage2[4]["peer_inputs"] == m and stage3[4]["peer_inputs"] == m, per_rank


class Dangling(nn.Module):
    """``a`` and ``head`` on stage 0, ``b3`` on stage 1, ``b2`` on stage 2. ``b2`` takes the data
    (no gradient goes back) and its output goes straight to ``b3``: once the leader has learned
    that it does not use that output, ``b2``'s calls are quiet (Note [Quiet calls]), and its
    gradient comes from stage 1 only, on a channel that the leader's end of the step does not
    order."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b2, self.b3 = Block(), Block()
        self.head = nn.Linear(16, 3)
        self.variant = 0

    def forward(self, x):
        v = self.b2(torch.cat([x, x], dim=1))
        return self.head(self.a(x) + self.b3(v))


def _dangling_worker():
    import smp
    from smp.pipeline import protocol, runtime

    smp.init({"pipeline_parallel_degree": 3, "microbatches": 4, "timeout_s": 30})
    send = runtime.Sender.send
    late = [False]  # this step, stage 1 sends its gradients for b2 only after its STEP_END
    held: list = []
    replies = [0]  # REPLYs from stage 2 to the leader this step

    def reordering_send(self, to, header, tensors, wait=False):
        replies[0] += smp.pp_rank() == 2 and to == 0 and header[0] == protocol.REPLY
        if late[0] and to == 2 and header[0] == protocol.GRAD_OUT:
            held.append((self, to, header, tensors))
            return None
        send(self, to, header, tensors, wait)
        if header[0] == protocol.STEP_END:
            while held:
                send(*held.pop(0))
        return None

    def place(module):
        for name, stage in [("a", 0), ("head", 0), ("b3", 1), ("b2", 2)]:
            smp.set_partition(getattr(module, name), stage)
        smp.set_partition(module, 0)

    def before_step(step, module):
        late[0] = step >= 2 and smp.pp_rank() == 1
        replies[0] = 0

    runtime.Sender.send = reordering_send
    try:
        return exact_steps(
            smp, Dangling, place, [0] * 4, 13, 4, before_step, lambda step: replies[0]
        )  # fmt: skip
    finally:
        runtime.Sender.send = send


def test_a_stage_stays_for_quiet_calls_still_waiting_for_gradients(pools):
    # From step 2 b2's calls are quiet (stage 2 sends the leader no REPLY), and stage 1 sends
    # b2's gradients after its end of step: stage 2 waited for them, and every step is exact.
    # Steps 0 and 1 learn: the structure from the first REPLY, then that the leader only passes
    # the output on. How many of their calls are already quiet depends on which microbatch
    # finishes first, so step 0 counts 1 to 4 REPLYs (the first call is always answered).
    replies = pools.run(3, _dangling_worker)[2]
    assert 1 <= replies[0] <= 4 and replies[2:] == [0, 0], replies


class HeadOnStage1(nn.Module):
    """``a`` on stage 0, ``block`` and ``head`` on stage 1: the root's output is a future."""

    def __init__(self):
        super().__init__()
        self.a, self.block, self.head = nn.Linear(8, 16), Block(), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.block(self.a(x)))


def _backward_from_futures_worker():
    import smp
    from smp.pipeline import calls, runtime

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 60})
    torch.manual_seed(0)
    reference = HeadOnStage1()
    torch.manual_seed(0)
    module = HeadOnStage1()
    smp.set_partition(module, 0)
    smp.set_partition(module.a, 0)
    smp.set_partition(module.block, 1)
    smp.set_partition(module.head, 1)
    model = smp.DistributedModel(module)
    unarrived = [0]  # roots model.backward took before their values had arrived
    backward = runtime.PipelineRuntime.backward

    def counting_backward(self, tensors, grad_tensors):
        roots = tensors if isinstance(tensors, (list, tuple)) else [tensors]
        unarrived[0] += sum(
            isinstance(t, calls._Future) and t._smp_call.values is None for t in roots
        )
        return backward(self, tensors, grad_tensors)

    @smp.step
    def given(model, x, g):  # the output's gradient given: it goes out with the GRAD_OUT
        out = model(x)
        model.backward(out, g)
        return out

    @smp.step
    def frozen(model, x):  # a loss that needs no gradient: an error, as in torch
        with torch.no_grad():
            loss = model(x).sum()
        model.backward(loss)

    @smp.step
    def short(model, x, g):  # fewer gradients than tensors: an error, not a dropped root
        out = model(x)
        model.backward([out, out.sum()], [g])

    @smp.step
    def broadcast(model, x, g):  # a gradient the output's shape broadcasts to: an error too
        model.backward(model(x), g)

    g = torch.Generator().manual_seed(3)
    runtime.PipelineRuntime.backward = counting_backward
    try:
        for step in range(3):
            x, grad = torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)
            unarrived[0] = 0
            for p in (*model.parameters(), *reference.parameters()):
                p.grad = None
            out = given(model, x, grad)
            for xs, gs in zip(x.chunk(2), grad.chunk(2)):
                reference(xs).backward(gs / 2)  # smp averages over the microbatches
            torch.testing.assert_close(out.concat(), reference(x), **TOL)
            assert_owned_grads_match(model, reference, smp.pp_rank(), TOL)
            if smp.pp_rank() == 0 and step > 0:  # step 0's calls waited for their outputs
                assert unarrived[0] == 2, (step, unarrived[0])
        for _ in range(2):  # the second time the output structure is predicted
            with pytest.raises(Exception, match="does not require grad"):
                frozen(model, torch.randn(8, 8, generator=g))
            with pytest.raises(Exception, match="got 2 tensors and 1 gradients"):
                short(model, torch.randn(8, 8, generator=g), torch.randn(4, 3, generator=g))
            # (4, 3) outputs given (4, 1, 4, 3) gradients: torch raises, where autograd's
            # engine alone would sum them down to (4, 3)
            with pytest.raises(Exception, match="Mismatch in shape"):
                broadcast(model, torch.randn(8, 8, generator=g), torch.randn(8, 1, 4, 3))
    finally:
        runtime.PipelineRuntime.backward = backward


def test_backward_of_outputs_that_have_not_arrived(pools):
    """model.backward(output, gradient) on a future goes out with its call's GRAD_OUT (Note
    [Backward from futures]), exactly; a future that needs no gradient raises as torch does, and
    so do fewer gradients than tensors and a gradient of another shape."""
    pools.run(2, _backward_from_futures_worker)


class Failing(Block):
    fail = False

    def forward(self, h):
        if self.fail:
            raise ValueError("b2 failed on purpose")
        return super().forward(h)


def _four_stage_failure_worker():
    import smp

    smp.init({"pipeline_parallel_degree": 4, "microbatches": 4, "timeout_s": 60})

    def make():
        model = FourStages()
        model.b2 = Failing()
        return model

    def place(module):
        for name, stage in [("a", 0), ("head", 0), ("b1", 1), ("b4", 1), ("b2", 2), ("b3", 3)]:
            smp.set_partition(getattr(module, name), stage)

    def before_step(step, module):
        module.b2.fail = step == 2

    # Step 2 (the chain, as in step 1) fails in b2 on stage 2, whose input comes straight from
    # stage 1 and whose output stage 3 is fetching; the steps after it are exact again.
    return exact_steps(smp, make, place, [1, 0, None, 1, 0], 11, 4, before_step, lambda s: None)


def test_a_failure_between_directly_connected_stages_fails_the_step_only(pools):
    for result in pools.run(4, _four_stage_failure_worker):
        assert "b2 failed on purpose" in result[2], result[2]


class UsesAValueAndItsNorm(nn.Module):
    """After the call to stage 1, the leader uses both x and ln(x), made before it, and in
    variant 1 also the weight x came from."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.ln = nn.LayerNorm(16)
        self.remote = Block()
        self.head = nn.Linear(16, 3)
        self.variant = 0

    def forward(self, inp):
        x = self.a(inp)
        y = self.ln(x)
        w = self.remote(y)
        out = self.head(x + y + w)
        return out * self.a.weight.sum() if self.variant == 1 else out


def _derived_worker(async_calls: bool):
    import smp

    smp.init(
        {"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline_async_calls": async_calls}
    )

    def place(module):
        for name in ("a", "ln", "head"):
            smp.set_partition(getattr(module, name), 0)
        smp.set_partition(module.remote, 1)

    exact_steps(
        smp, UsesAValueAndItsNorm, place, [0, 1, 0, 1], 13, 2, lambda s, m: None, lambda s: None
    )


@pytest.mark.parametrize("async_calls", [True, False])
def test_values_from_before_a_call_and_values_derived_from_them(pools, async_calls):
    pools.run(2, _derived_worker, async_calls)


def _sliced_worker():
    from model import GPT, GPTConfig, lm_loss

    import smp

    # Slices on both stages: without the zero-bubble split, which replaces them on stage 1.
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "deferred_weight_microbatches": 0})
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.0)
    torch.manual_seed(0)
    reference = GPT(config)
    torch.manual_seed(0)
    model = smp.DistributedModel(GPT(config))

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(5)
    slices = []
    for _ in range(2):
        tokens = torch.randint(0, 64, (4, 17), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        for p in model.parameters():
            p.grad = None
        reference.zero_grad()
        loss = train_step(model, x, y).reduce_mean()
        ref = sum(lm_loss(reference(a), b) for a, b in zip(x.chunk(2), y.chunk(2))) / 2
        ref.backward()
        assert abs(loss.item() - ref.item()) < 1e-5
        assert_owned_grads_match(model, reference, smp.pp_rank(), dict(rtol=1e-5, atol=1e-5))
        slices.append(model._runtime.slices_run)
    runtime = model._runtime
    paths = {id(m): p for p, m in runtime.modules.items()}
    local_blocks = [f"h.{i}" for i in range(4) if runtime.assignment[f"h.{i}"] == smp.pp_rank()]
    return sorted(paths[i] for i in runtime.slice_before), local_blocks, slices


def test_large_modules_slice_the_backward_and_stay_exact(pools):
    """Every block on a stage starts a backward slice (design.md §4.4), and nothing inside a
    block does (its MLP is as large, but a slice there would cut the residual stream twice):
    the backward of the intervals between them runs as separate tasks, and the gradients stay
    exact. Stage 1 serves each block as a call of its own, which starts an interval anyway:
    no slice runs there."""
    results = pools.run(2, _sliced_worker)
    for sliced, blocks, _ in results:
        assert blocks and set(blocks) <= set(sliced), (sliced, blocks)
        assert not [p for p in sliced for b in blocks if p.startswith(b + ".")], sliced
    assert all(n > 0 for n in results[0][2]) and results[1][2] == [0, 0], results


class _WeightGate(torch.autograd.Function):
    """Identity on a weight; its backward runs in the weight half of the owner's split (it is
    on the path to the weight only) and fails while ``fail`` is set, at its ``fail_at``-th call
    of the step: the last microbatch's, whose weight half runs, when deferred, after the stage
    has sent its last input gradient and the leader has finished its part of the step (the
    failure must still reach the leader as this stage's error)."""

    fail = False
    fail_at = 1
    calls = 0

    @staticmethod
    def forward(ctx, weight):
        return weight.clone()

    @staticmethod
    def backward(ctx, grad):
        _WeightGate.calls += 1
        if _WeightGate.fail and _WeightGate.calls >= _WeightGate.fail_at:
            raise RuntimeError("weight gradient failed on purpose")
        return grad


class GatedBlock(Block):
    def forward(self, h):
        return torch.tanh(F.linear(h, _WeightGate.apply(self.fc.weight), self.fc.bias)) + h


class SplitChain(nn.Module):
    """``a`` and ``head`` on stage 0; on stage 1 two blocks, the first with a gated weight."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        self.b1, self.b2 = GatedBlock(), Block()
        self.variant = 0

    def forward(self, x):
        return self.head(self.b2(self.b1(self.a(x))))


def _split_worker(deferred: int):
    import smp

    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 4,
            "deferred_weight_microbatches": deferred,
            "timeout_s": 60,
        }
    )

    def place(module):
        for name, stage in [("a", 0), ("head", 0), ("b1", 1), ("b2", 1)]:
            smp.set_partition(getattr(module, name), stage)

    def before_step(step, module):
        _WeightGate.fail = step == 2
        _WeightGate.fail_at, _WeightGate.calls = 4, 0  # the last microbatch's weight gradient

    from smp.state import get_state

    def after_step(step):
        runtime = get_state().runtimes[-1]
        return runtime.weights_run, runtime.slices_run

    # Step 2 fails in a weight half on stage 1; the steps after it are exact again.
    return exact_steps(smp, SplitChain, place, [0, 0, None, 0], 13, 4, before_step, after_step)


@pytest.mark.parametrize("deferred", [0, 1, 4])
def test_weight_gradients_apart_are_exact_and_fail_cleanly(pools, deferred):
    """Stage 1 computes its served calls' input gradients first and their weight gradients as
    separate tasks (design.md §4.4) for the step's last ``deferred`` microbatches: one per
    served call and such microbatch (2 blocks x 1 or 4), none on the leader, none with the
    split off. Gradients match the reference however many microbatches' weights may wait, and
    a weight task that fails fails the step everywhere."""
    for rank, result in enumerate(pools.run(2, _split_worker, deferred)):
        expected = 2 * deferred if rank == 1 else 0
        assert [r[0] for i, r in enumerate(result) if i != 2] == [expected] * 3, result
        assert "weight gradient failed on purpose" in result[2], result[2]
        if rank == 0:  # the failing stage raises its own error; the others name where it was
            assert "stage 1, microbatch 3, module 'b1'" in result[2], result[2]


class MemoBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h, scale, memo):
        y = torch.tanh(self.fc(h + memo[-1])) + scale  # (an add saves no operand)
        memo.append(y)  # a changed argument: the caller's list gets it
        return y


class Memo(nn.Module):
    """Every block on stage 1 takes the same ``h`` (requires grad), the same ``scale`` (does
    not) and a list that each block appends to, as a Hugging Face decoder's layers take one
    rotary embedding and one cache. Variant 1 changes ``scale`` in place before block 2, so
    it must travel again."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        self.blocks = nn.ModuleList(MemoBlock() for _ in range(4))
        self.variant = 0

    def forward(self, x):
        h = self.a(x)
        scale = torch.sigmoid(x.detach()).repeat(1, 2)
        memo = [torch.tanh(h)]
        out = h
        for i, block in enumerate(self.blocks):
            if self.variant == 1 and i == 2:
                with torch.no_grad():
                    scale.mul_(0.5)
            out = block(h, scale, memo)
        return self.head(out + memo[0] + memo[2])


def _memo_worker(send_once: bool, root: int = 0):
    import smp
    from smp.core import messages
    from smp.pipeline import protocol, runtime
    from smp.pipeline.sender import Sender

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "timeout_s": 60})
    runtime.PipelineRuntime.send_once = send_once
    counts = {"again": 0, "payload": 0}
    send = Sender.send

    def counting_send(self, peer, header, tensors, wait=False):
        if header[0] == protocol.REQUEST and header[3] != protocol._FETCH:
            refs = header[7 : 7 + 4 * header[6]]
            counts["again"] += sum(1 for stage in refs[1::4] if stage == messages.INPUT)
            counts["payload"] += len(tensors) - 1  # the skeleton aside
        return send(self, peer, header, tensors, wait)

    def place(module):
        smp.set_partition(module, root)
        for name, stage in [("a", 0), ("head", 0), ("blocks", 1)]:
            smp.set_partition(getattr(module, name), stage)

    def after_step(step):
        out = dict(counts)
        counts.update(again=0, payload=0)
        return out

    Sender.send = counting_send
    try:
        return exact_steps(smp, Memo, place, [0, 1, 0], 5, 2, lambda *_: None, after_step)
    finally:
        Sender.send = send
        runtime.PipelineRuntime.send_once = True


@pytest.mark.parametrize("send_once", [True, False])
def test_tensors_sent_before_go_as_references_and_stay_exact(pools, send_once):
    """A tensor a stage sent an owner before in the microbatch, unchanged since, goes to it
    again as a reference (Note [Tensors sent once]): the blocks' shared ``h``, ``scale`` and
    the list's first tensor travel once per microbatch, with every gradient exact (``h``'s
    reaches it from every block), and ``scale`` travels again once changed in place."""
    leader = pools.run(2, _memo_worker, send_once)[0]
    m = 2
    # Step 0's calls wait for their outputs (no structure is known yet), so the tensors the
    # blocks append come back and go out again (sent once, referred to after).
    if send_once:
        # From step 1, block 0 sends h, scale and memo[0]; blocks 1-3 name them (the tensors
        # appended on stage 1 are its outputs, references already).
        assert leader[1:] == [
            {"again": 8 * m, "payload": 4 * m},  # scale again for block 2
            {"again": 9 * m, "payload": 3 * m},
        ], leader
        assert leader[0]["again"] > 9 * m, leader
    else:
        assert [r["again"] for r in leader] == [0, 0, 0], leader
        assert [r["payload"] for r in leader[1:]] == [12 * m, 12 * m], leader


@pytest.mark.parametrize("root", [0, 1])
def test_local_modules_change_the_lists_they_are_given(pools, root):
    """With the root on stage 1, the blocks are local to it and get the list itself, futures
    in it resolved in place: before, any list holding a tensor reached a local module as a
    copy during a pipelined step, and what the module appended was lost. With the root on
    stage 0, the list crosses and comes back changed."""
    pools.run(2, _memo_worker, True, root)


class Side(nn.Module):
    """Its output is not used (the root drops it): its calls go quiet, and the leader's
    microbatch may finish before one runs. With ``call_out`` it calls a module of the leader's
    stage, so the call goes otherwise then."""

    call_out = False

    def __init__(self, helper: nn.Module):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self._helper = [helper]  # the root's submodule, not this one's

    def forward(self, h):
        y = torch.tanh(self.fc(h))
        if Side.call_out:
            y = y + self._helper[0](y)
        return y


class DropsSide(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head, self.helper = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(16, 16)
        self.side = Side(self.helper)
        self.variant = 0

    def forward(self, x):
        h = self.a(x)
        self.side(h)
        return self.head(h)


def _late_answer_worker():
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "timeout_s": 60})

    def place(module):
        for path, stage in [("", 0), ("a", 0), ("head", 0), ("helper", 0), ("side", 1)]:
            smp.set_partition(module.get_submodule(path), stage)

    def before_step(step, module):
        Side.call_out = step >= 3

    def after_step(step):
        return smp.state.get_state().runtimes[0].reruns if smp.pp_rank() == 0 else None

    try:
        return exact_steps(smp, DropsSide, place, [0] * 5, 1, 4, before_step, after_step)
    finally:
        Side.call_out = False


def test_a_quiet_call_may_go_otherwise_after_its_microbatch_finished(pools):
    """``side``'s calls are quiet from the second step, and the leader does not wait for them:
    when one calls the leader's stage (step 3), the leader may have finished that microbatch.
    Its answer is handed out late (Note [Late answers] in server.cpp) and the step runs again,
    exactly; before, the policy's check failed the step ("already finished") when the race
    went that way (1 run in 4 here)."""
    reruns = pools.run(2, _late_answer_worker)[0]
    assert reruns == [0, 0, 0, 1, 1], reruns

"""The orders the pipeline runtime really issues, checked on the stream model (design.md §4.8,
Device ordering; ``tests/python/unit/stream_model.py``).

Each rank records its last step's host order: the spans of its tasks (the timeline's recorder),
each message it queues, and each message the server hands to the task it runs next. On the CPU
the messages travel on gloo, but the order is the one the runtime would issue on GPUs, where
every activation and gradient travels on the NCCL streams; the model then says whether that
order can deadlock under the stream rule. It must not, whichever order the runtime picked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from models import build_model, gpt_train_step, make_batch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import stream_model as sm  # noqa: E402

REQUEST, REPLY, GRAD_OUT, GRAD_IN = 1, 2, 3, 4  # smp.pipeline.protocol (checked in the workers)


def _carries_device_tensors(header, n: int) -> bool:
    """Whether a message's payload would travel on the NCCL streams: a REQUEST's or REPLY's
    tensors after the first (its pickled skeleton, host bytes), every tensor of a gradient
    message. ERROR and STEP_END carry none that a device holds."""
    if header[0] in (REQUEST, REPLY):
        return n > 1
    return header[0] in (GRAD_OUT, GRAD_IN) and n > 0


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h):
        return torch.tanh(self.fc(h)) + h


class _FourStages(nn.Module):
    """``a`` and ``head`` on stage 0, ``b1`` and ``b4`` on stage 1, ``b2`` on 2, ``b3`` on 3: the
    activations go 0 -> 1 -> 2 -> 3 -> 1 -> 0 and the gradients back, so stage 1 talks to
    stages 0, 2 and 3 in both directions, and stage 0 to stage 3 through fetched outputs."""

    placement = {"a": 0, "head": 0, "b1": 1, "b4": 1, "b2": 2, "b3": 3}

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b1, self.b2, self.b3, self.b4 = (_Block() for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.b4(self.b3(self.b2(self.b1(self.a(x))))))


def _recording(log: list):
    """Patches the runtime so that ``log`` holds this rank's last step, in the order the host
    issued it; returns a function that undoes the patches."""
    from smp.pipeline import protocol, runtime, workers

    assert (protocol.REQUEST, protocol.REPLY, protocol.GRAD_OUT, protocol.GRAD_IN) == (
        REQUEST, REPLY, GRAD_OUT, GRAD_IN
    )  # fmt: skip
    saved = (
        workers._Recorder.begin,
        workers._Recorder.end,
        runtime.Sender.send,
        runtime.PipelineRuntime._take_item,
        runtime.PipelineRuntime.run_step,
    )
    begin, end, send, next_item, run_step = saved

    def recording_begin(self, kind, microbatch):
        log.append(("begin", kind, microbatch))
        begin(self, kind, microbatch)

    def recording_end(self):
        log.append(("end",))
        end(self)

    def recording_send(self, peer, header, tensors, wait=False):
        log.append(("send", peer, list(header), len(tensors)))
        return send(self, peer, header, tensors, wait)

    def recording_next_item(self):
        item = next_item(self)
        if item is not None and item[1] is not None:
            peer, header, tensors = item[1]
            log.append(("take", peer, list(header), len(tensors)))
        return item

    def recording_run_step(self, *args, **kwargs):
        log.clear()  # only the last step (a step run again starts over)
        return run_step(self, *args, **kwargs)

    workers._Recorder.begin, workers._Recorder.end = recording_begin, recording_end
    runtime.Sender.send = recording_send
    runtime.PipelineRuntime._take_item = recording_next_item
    runtime.PipelineRuntime.run_step = recording_run_step

    def restore():
        (
            workers._Recorder.begin,
            workers._Recorder.end,
            runtime.Sender.send,
            runtime.PipelineRuntime._take_item,
            runtime.PipelineRuntime.run_step,
        ) = saved

    return restore


def _config(degree: int, microbatches: int, schedule: str) -> dict:
    pipeline, _, program = schedule.partition("/")  # "static/1f1b": that program's order
    options = {"pipeline_schedule": program} if program else {}
    return {
        "pipeline_parallel_degree": degree,
        "microbatches": microbatches,
        "pipeline": pipeline,
        "timeout_s": 60,
    } | options


def _gpt_worker(microbatches: int, schedule: str) -> list:
    import smp

    log: list = []
    restore = _recording(log)
    try:
        smp.init(_config(2, microbatches, schedule))
        torch.manual_seed(0)
        model = smp.DistributedModel(build_model("gpt"))
        train_step = gpt_train_step(smp)
        for step in range(2):
            train_step(model, *make_batch("gpt", 2 * microbatches, step))
    finally:
        restore()
    return log


def _four_stage_worker(microbatches: int, schedule: str) -> list:
    import smp

    log: list = []
    restore = _recording(log)
    try:
        smp.init(_config(4, microbatches, schedule))
        torch.manual_seed(0)
        module = _FourStages()
        for name, stage in module.placement.items():
            smp.set_partition(getattr(module, name), stage)
        model = smp.DistributedModel(module)

        @smp.step
        def train_step(model, x, y):
            loss = F.cross_entropy(model(x), y)
            model.backward(loss)
            return loss

        g = torch.Generator().manual_seed(5)
        for _ in range(2):
            x = torch.randn(2 * microbatches, 8, generator=g)
            train_step(model, x, torch.randint(0, 3, (2 * microbatches,), generator=g))
    finally:
        restore()
    return log


def _check_orders(logs: dict[int, list], microbatches: int) -> None:
    # The recording saw a real step: every rank ran spans and moved device payloads both ways.
    for rank, log in logs.items():
        kinds = {event[0] for event in log}
        assert {"begin", "end", "send", "take"} <= kinds, (rank, kinds)
        device = [e for e in log if e[0] in ("send", "take") and _carries_device_tensors(*e[2:])]
        assert {e[0] for e in device} == {"send", "take"}, (rank, log)
        mbs = {e[2] for e in log if e[0] == "begin"}
        assert mbs == set(range(microbatches)), (rank, mbs)
    for receives in ("latest", "earliest"):
        traces = sm.runtime_traces(logs, _carries_device_tensors, receives)
        graph = sm.build(traces, "new")
        sent = sum(a[0] == "send" for t in traces.values() for a in t)
        assert len(graph.pairs) == sent > 0
        deadlock = sm.find_deadlock(graph)
        assert deadlock is None, f"receives posted {receives}: {deadlock}"


@pytest.mark.parametrize("schedule", ["interleaved", "simple", "static/1f1b", "static/zbh1"])
def test_two_stage_orders_cannot_deadlock(pools, schedule):
    microbatches = 4
    logs = pools.run(2, _gpt_worker, microbatches, schedule)
    _check_orders(dict(enumerate(logs)), microbatches)


@pytest.mark.parametrize("schedule", ["interleaved", "static/1f1b", "static/zbh1"])
def test_four_stage_orders_cannot_deadlock(pools, schedule):
    microbatches = 4
    logs = pools.run(4, _four_stage_worker, microbatches, schedule, timeout_s=300)
    _check_orders(dict(enumerate(logs)), microbatches)

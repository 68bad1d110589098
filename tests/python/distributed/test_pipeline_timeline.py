"""smp.last_step_timeline(): what each pipeline rank ran in the last step, as IR actions."""

from __future__ import annotations

import json

import pytest
import torch
from models import build_model, loss_fn, make_batch


def _timeline_worker(tmp: str, schedule: str) -> dict:
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": schedule})
    torch.manual_seed(0)
    model = smp.DistributedModel(build_model("gpt"))

    @smp.step
    def train_step(model, x, y):
        loss = loss_fn("gpt", model(x), y)
        model.backward(loss)
        return loss

    x, y = make_batch("gpt", 8, 0)
    with pytest.raises(RuntimeError, match="no pipelined step has run"):
        smp.last_step_timeline()
    for _ in range(2):
        train_step(model, x, y)
    timeline = smp.last_step_timeline()
    path = f"{tmp}/trace{smp.rank()}.json"
    timeline.save_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    from smp import _C

    schedule = timeline.to_schedule()
    # Every (stage, type, microbatch) once, in an order the chain's dependencies allow.
    _C.schedule.validate_schedule(schedule, 2, 4, [0, 1])
    return {
        "schedule": [[str(a) for a in program] for program in schedule],
        "csv": _C.schedule.to_csv(schedule),
        "program": timeline.program(),
        "spans": {r: [(a.start, a.end) for a in acts] for r, acts in timeline.ranks.items()},
        "pieces_by_action": {
            r: [(a.action, a.start, a.end) for a in acts] for r, acts in timeline.ranks.items()
        },
        "events": len([e for e in trace["traceEvents"] if e["ph"] == "X"]),
        "pieces": sum(len(a) for a in timeline.ranks.values()),
        "summary": timeline.summary(),
    }


@pytest.mark.parametrize("schedule", ["interleaved", "simple"])
def test_timeline_records_every_microbatch_on_every_stage(pools, tmp_path, schedule):
    results = pools.run(2, _timeline_worker, str(tmp_path), schedule)
    r = results[0]
    assert results[1]["program"] == r["program"]  # every rank gets the same timeline
    for rank, program in r["program"].items():
        for mb in range(4):
            assert f"{rank}F{mb}" in program and f"{rank}B{mb}" in program, (rank, program)
        assert all(a[1] in "FBW" and int(a[0]) == rank for a in program), program
        # Stage 1 serves its calls with their weight gradients apart (design.md §4g); the
        # leader never splits.
        assert all((f"{rank}W{mb}" in program) == (rank == 1) for mb in range(4)), program
        # No two pieces of one rank overlap, and each backward follows its forward.
        spans = r["spans"][rank]
        assert all(s <= e for s, e in spans)
        assert all(e1 <= s2 + 1e-6 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        for mb in range(4):
            assert program.index(f"{rank}F{mb}") < program.index(f"{rank}B{mb}")
    assert r["events"] == r["pieces"]
    _check_causality(r["pieces_by_action"], microbatches=4)
    # The projection onto the IR (validated in the workers) holds each action once per stage.
    for stage, program in enumerate(r["schedule"]):
        kinds = "FB" if stage == 0 else "FIW"
        assert sorted(program) == sorted(f"{stage}{k}{mb}" for k in kinds for mb in range(4))
        assert program.index(f"{stage}F0") < program.index(f"{stage}{kinds[1]}0")
    assert r["csv"].splitlines()[0].startswith("0F0,")


def test_a_schedule_the_runtime_could_not_have_run_is_rejected():
    """The validator the timeline test relies on fails an order no run can have: stage 0 waits
    for backward 0 before it starts forward 1, while stage 1 wants forward 1 before backward 0."""
    from smp import _C
    from smp.timeline import TimedAction, Timeline

    def acts(names):
        return [TimedAction(n, float(i), float(i) + 0.5) for i, n in enumerate(names)]

    timeline = Timeline(
        {0: acts(["0F0", "0B0", "0F1", "0B1"]), 1: acts(["1F0", "1F1", "1B1", "1B0"])}
    )
    schedule = timeline.to_schedule()
    assert [[str(a) for a in p] for p in schedule] == [
        ["0F0", "0B0", "0F1", "0B1"],
        ["1F0", "1F1", "1B1", "1B0"],
    ]
    with pytest.raises(ValueError, match="deadlocks"):
        _C.schedule.validate_schedule(schedule, 2, 2, [0, 1])


def _check_causality(ranks: dict, microbatches: int, skew: float = 1e-3) -> None:
    """What the module server's messages impose on the recorded pieces (times are wall-clock
    across processes on one machine; ``skew`` allows for the per-rank clock offsets): a stage
    starts a microbatch only after the leader (which runs the root's forward) has started it;
    another stage's backward of a microbatch starts after all its forward pieces of it ended (on
    the leader, the step function goes on after ``model.backward``); and the leader's backward
    of a microbatch ends last, after every other stage's (GRAD_IN). A weight half ("W") starts
    after its microbatch's first backward piece on that rank has ended."""

    def pieces(rank, kind, mb):
        return [(s, e) for a, s, e in ranks[rank] if a == f"{rank}{kind}{mb}"]

    for mb in range(microbatches):
        leader_forward = pieces(0, "F", mb)
        leader_backward = pieces(0, "B", mb)
        for rank in ranks:
            forward, backward = pieces(rank, "F", mb), pieces(rank, "B", mb)
            assert forward[0][0] >= leader_forward[0][0] - skew, (rank, mb, ranks)
            if rank != 0:
                assert max(e for _, e in forward) <= backward[0][0] + skew, (rank, mb, ranks)
            assert max(e for _, e in backward) <= leader_backward[-1][1] + skew, (rank, mb, ranks)
            for start, _ in pieces(rank, "W", mb):
                assert start >= backward[0][1] - 1e-6, (rank, mb, ranks)

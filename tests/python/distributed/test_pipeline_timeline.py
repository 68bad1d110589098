"""smp.last_step_timeline(): what each pipeline rank ran in the last step, as IR actions."""

from __future__ import annotations

import json

import pytest
import torch
from models import build_model, gpt_train_step, make_batch


def _timeline_worker(tmp: str, schedule: str) -> dict:
    import smp

    pipeline, _, program = schedule.partition("/")  # "static/1f1b": that program's order
    options = {"pipeline_schedule": program} if program else {}
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": pipeline} | options)
    torch.manual_seed(0)
    model = smp.DistributedModel(build_model("gpt"))

    train_step = gpt_train_step(smp)

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
        "costs": [
            (c.forward, c.full_backward, c.backward_input, c.backward_weight)
            for c in timeline.stage_costs()
        ],
        "replayed": _C.schedule.simulate(schedule, timeline.stage_costs()).makespan,
    }


@pytest.mark.parametrize("schedule", ["interleaved", "simple", "static/zbh1", "static/1f1b"])
def test_timeline_records_every_microbatch_on_every_stage(pools, tmp_path, schedule):
    results = pools.run(2, _timeline_worker, str(tmp_path), schedule)
    r = results[0]
    splits = schedule != "static/1f1b"  # 1F1B's program has no weight halves
    # Under a program every microbatch splits; else the step's last deferred_weight_microbatches
    # (2 by default at pp 2, design.md §4.4)
    split_mbs = range(4) if schedule.startswith("static") else range(2, 4)
    assert results[1]["program"] == r["program"]  # every rank gets the same timeline
    for rank, program in r["program"].items():
        for mb in range(4):
            assert f"{rank}F{mb}" in program and f"{rank}B{mb}" in program, (rank, program)
        assert all(a[1] in "FBW" and int(a[0]) == rank for a in program), program
        # Stage 1 serves its calls with their weight gradients apart (design.md §4.4); the
        # leader never splits.
        for mb in range(4):
            assert (f"{rank}W{mb}" in program) == (rank == 1 and splits and mb in split_mbs)
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
        split = stage == 1 and splits
        kinds = {mb: "FIW" if split and mb in split_mbs else "FB" for mb in range(4)}
        assert sorted(program) == sorted(f"{stage}{k}{mb}" for mb in range(4) for k in kinds[mb])
        assert program.index(f"{stage}F0") < program.index(f"{stage}{kinds[0][1]}0")
    assert r["csv"].splitlines()[0].startswith("0F0,")
    # Per-stage costs: each type's pieces over the step, per microbatch.
    for stage, (f, b, i, w) in enumerate(r["costs"]):
        pieces = r["pieces_by_action"][stage]

        def spent(kind, mbs, pieces=pieces):
            return sum(e - s for a, s, e in pieces if a[1] == kind and int(a[2:]) in mbs)

        mbs = range(4)
        assert (f, b) == pytest.approx(
            (spent("F", mbs) / 4, (spent("B", mbs) + spent("W", mbs)) / 4)
        )
        if stage == 1 and splits:  # input and weight halves, of the microbatches that split
            n = len(split_mbs)
            assert (i, w) == pytest.approx((spent("B", split_mbs) / n, spent("W", split_mbs) / n))
            assert w > 0
        else:
            assert i == pytest.approx(b) and w == 0
        assert f > 0 and i > 0
    assert r["replayed"] > 0
    if schedule.startswith("static"):
        # The leader starts microbatch k only once every microbatch whose backward comes
        # before F k in its program has finished (its last backward piece has ended). Both
        # programs here are 1F1B's on stage 0: F0 F1 B0 F2 B1 F3 B2 B3 (I for B in ZB-H1's).
        from smp import _C

        generate = {"zbh1": _C.schedule.zero_bubble_h1, "1f1b": _C.schedule.one_f_one_b}
        program = [str(a) for a in generate[schedule.partition("/")[2]](2, 4)[0] if a]
        assert [a.replace("I", "B") for a in program if "W" not in a] == [
            "0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"
        ]  # fmt: skip
        pieces = r["pieces_by_action"][0]
        first_forward = {a: min(s for x, s, _ in pieces if x == a) for a in ("0F2", "0F3")}
        last_backward = {a: max(e for x, _, e in pieces if x == a) for a in ("0B0", "0B1")}
        assert last_backward["0B0"] <= first_forward["0F2"] + 1e-6, pieces
        assert last_backward["0B1"] <= first_forward["0F3"] + 1e-6, pieces


def test_stage_costs_turn_a_step_into_what_other_schedules_would_take():
    from smp import _C
    from smp.core.timeline import TimedAction, Timeline

    def acts(spec):
        return [TimedAction(n, float(s), float(e)) for n, s, e in map(str.split, spec.split(","))]

    # Stage 0: forwards of 1 s (one in two pieces), backwards of 2 s; stage 1: forwards of 2 s,
    # input halves of 3 s and weight halves of 1 s.
    timeline = Timeline(
        {
            0: acts("0F0 0 0.5, 0F0 0.7 1.2, 0F1 1.2 2.2, 0B0 8 10, 0B1 14 16"),
            1: acts(
                "1F0 1.2 3.2, 1B0 3.2 6.2, 1F1 6.2 8.2, 1W0 8.2 9.2, 1B1 9.2 12.2, 1W1 12.2 13.2"
            ),
            2: acts("1F0 1.2 9.0"),  # a replica of stage 1: not counted
        }
    )
    first, last = timeline.stage_costs()
    fields = ("forward", "full_backward", "backward_input", "backward_weight")
    assert tuple(getattr(first, f) for f in fields) == pytest.approx((1.0, 2.0, 2.0, 0.0))
    assert tuple(getattr(last, f) for f in fields) == pytest.approx((2.0, 4.0, 3.0, 1.0))
    # Stage 1 is the slower: 1F1B takes F0 + m (F1 + B1) + B0 = 1 + 12 + 2.
    one_f_one_b = _C.schedule.one_f_one_b(2, 2)
    assert _C.schedule.simulate(one_f_one_b, [first, last]).makespan == pytest.approx(15.0)
    with pytest.raises(ValueError, match="1 per-stage costs for a schedule of 2 stages"):
        _C.schedule.simulate(one_f_one_b, [first])


def test_a_schedule_the_runtime_could_not_have_run_is_rejected():
    """The validator the timeline test relies on fails an order no run can have: stage 0 waits
    for backward 0 before it starts forward 1, while stage 1 wants forward 1 before backward 0."""
    from smp import _C
    from smp.core.timeline import TimedAction, Timeline

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

"""smp._C.ServerPolicy through the binding: the pipeline server's queue and policy in Python.

The rules themselves are tested in C++ (tests/cpp/core/server_policy_test.cpp); this checks that
the binding exposes them faithfully: enums, read-only tasks, ``next()`` returning ``None``, string
or enum policy names, and smp::Error surfacing as ValueError.
"""

from __future__ import annotations

import pytest

from smp import _C

K = _C.TaskKind


def label(task: _C.Task | None) -> str:
    """Short form of a task as in the C++ tests: "S0", "R1#7", "B0#8", or "-" for None."""
    if task is None:
        return "-"
    letter = {
        K.START_MICROBATCH: "S",
        K.SERVE_REQUEST: "Q",
        K.RESUME: "R",
        K.BACKWARD: "B",
        K.WEIGHT: "W",
    }
    text = f"{letter[task.kind]}{task.microbatch}"
    return text if task.kind == K.START_MICROBATCH else f"{text}#{task.id}"


@pytest.mark.parametrize("kind", ["interleaved", _C.PipelineKind.INTERLEAVED])
def test_interleaved_leader_sequence(kind):
    policy = _C.ServerPolicy(kind, num_microbatches=3, active_microbatches=2, is_leader=True)
    assert policy.kind == _C.PipelineKind.INTERLEAVED
    assert (policy.num_microbatches, policy.active_microbatches, policy.is_leader) == (3, 2, True)
    got = [label(policy.next()) for _ in range(3)]
    assert got == ["S0", "S1", "-"]
    assert policy.num_in_flight() == 2

    policy.push(K.SERVE_REQUEST, 1, 20)
    policy.push(K.RESUME, 0, 10)
    assert label(policy.next()) == "R0#10"  # resume before request
    policy.on_forward_done(0)
    policy.push(K.BACKWARD, 0, 30)
    assert policy.num_queued() == 2
    assert [label(policy.next()) for _ in range(3)] == ["B0#30", "Q1#20", "-"]
    policy.on_microbatch_finished(0)
    assert label(policy.next()) == "S2"  # a slot freed
    policy.on_microbatch_finished(1)
    policy.on_microbatch_finished(2)
    assert policy.all_finished()
    assert policy.next() is None


def test_simple_holds_backwards_until_every_forward_is_done():
    policy = _C.ServerPolicy("simple", 2, 1, True)
    assert [label(policy.next()) for _ in range(3)] == ["S0", "S1", "-"]  # active not a limit
    policy.push(K.RESUME, 0, 1)
    assert label(policy.next()) == "R0#1"
    policy.on_forward_done(0)
    policy.push(K.BACKWARD, 0, 2)
    assert policy.next() is None
    assert "held" in policy.describe()
    policy.on_forward_done(1)
    assert label(policy.next()) == "B0#2"


def test_non_leader_and_task_fields():
    policy = _C.ServerPolicy(_C.PipelineKind.SIMPLE, 4, 2, False)
    pushed = policy.push(K.BACKWARD, 3, 7)
    assert (pushed.kind, pushed.microbatch, pushed.id, pushed.sequence) == (K.BACKWARD, 3, 7, 0)
    policy.push(K.SERVE_REQUEST, 1, 8)
    first = policy.next()
    assert label(first) == "Q1#8" and first.sequence == 1
    task = policy.next()
    assert task == pushed and hash(task) == hash(pushed)
    assert task != first and (task == 3) is False
    assert repr(task) == "Task(backward(mb=3, id=7, seq=0))"
    with pytest.raises(AttributeError):
        task.microbatch = 0  # read-only
    assert policy.next() is None and policy.all_finished()
    assert _C.task_kind_name(K.SERVE_REQUEST) == "request"
    assert _C.parse_pipeline_kind("simple") == _C.PipelineKind.SIMPLE
    assert _C.pipeline_kind_name(_C.PipelineKind.INTERLEAVED) == "interleaved"


def test_static_takes_a_program_of_action_strings():
    policy = _C.ServerPolicy("static", 2, 2, False, 0, ["1F0", "1I0", "1W0", "1F1", "1I1", "1W1"])
    assert policy.kind == _C.PipelineKind.STATIC
    policy.push(K.SERVE_REQUEST, 1, 1)
    policy.push(K.WEIGHT, 0, 2)
    assert [label(policy.next()), label(policy.next())] == ["W0#2", "Q1#1"]
    assert "program: 1F0 1I0 1W0 1F1 1I1 1W1" in policy.describe()
    with pytest.raises(ValueError, match="1X0"):
        _C.ServerPolicy("static", 2, 2, False, 0, ["1X0"])
    with pytest.raises(ValueError, match="no compute action"):
        _C.ServerPolicy("static", 2, 2, False)


def test_errors_are_value_errors_naming_the_value():
    with pytest.raises(ValueError, match='"gpipe"'):
        _C.ServerPolicy("gpipe", 4, 2, True)
    with pytest.raises(ValueError, match=r"active_microbatches.*got 5"):
        _C.ServerPolicy("interleaved", 4, 5, True)
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        _C.ServerPolicy("simple", 0, 1, False)
    policy = _C.ServerPolicy("interleaved", 2, 2, True)
    with pytest.raises(_C.Error, match="start tasks are generated"):
        policy.push(K.START_MICROBATCH, 0, 0)
    with pytest.raises(ValueError, match="microbatch 1, which has not been started"):
        policy.push(K.RESUME, 1, 3)
    with pytest.raises(ValueError, match="microbatch 0 has not been started"):
        policy.on_microbatch_finished(0)
    with pytest.raises(ValueError, match="leader"):
        _C.ServerPolicy("interleaved", 2, 2, False).on_forward_done(0)

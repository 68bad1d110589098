"""The schedule IR from Python: generators, lowering, validation, CSV and the simulator."""

from __future__ import annotations

import pytest

from smp._C import schedule as ir


def test_action_strings_round_trip():
    for text in ("1F0", "0B3", "2I1", "2W1", "1SEND_F2", "0RECV_B3"):
        assert str(ir.Action.parse(text)) == text
    with pytest.raises(ValueError, match="1X0"):
        ir.Action.parse("1X0")


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (3, 5)])
def test_one_f_one_b_lowered_validates_and_meets_the_closed_form(p, m):
    program = ir.one_f_one_b(p, m)
    stage_to_rank = list(range(p))
    ir.validate_schedule(program, p, m, stage_to_rank)
    lowered = ir.add_communication(program, stage_to_rank)
    ir.validate_schedule(lowered, p, m, stage_to_rank)
    assert ir.from_csv(ir.to_csv(lowered)) == lowered
    timeline = ir.simulate(lowered)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert timeline.peak_in_flight == [min(p - r, m) for r in range(p)]


def test_zero_bubble_beats_one_f_one_b():
    zb = ir.simulate(ir.zero_bubble_h1(4, 8)).bubble_fraction
    assert zb < ir.simulate(ir.one_f_one_b(4, 8)).bubble_fraction


def test_validator_marks_the_failing_step():
    program = ir.one_f_one_b(2, 4)
    rank1 = program[1]
    first_b = next(i for i, a in enumerate(rank1) if a is not None and a.type == "B")
    first_f = next(i for i, a in enumerate(rank1) if a is not None and a.type == "F")
    rank1[first_b], rank1[first_f] = rank1[first_f], rank1[first_b]  # B before its F
    with pytest.raises(ValueError) as info:
        ir.validate_schedule(program, 2, 4, [0, 1])
    assert ">" in str(info.value) and "<" in str(info.value)


def test_timeline_actions_are_ir_actions():
    """smp.last_step_timeline() names its pieces in the IR's string form."""
    for text in ("0F3", "1B0"):
        action = ir.Action.parse(text)
        assert action.is_compute and str(action) == text

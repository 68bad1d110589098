"""The pipeline runtime's GPU stream discipline (design.md §4.8, Device ordering), checked on the
stream model of ``stream_model.py``: the schedule IR's programs cannot deadlock under it, the
discipline it replaces can, and the checker rejects hand-written wrong orders."""

from __future__ import annotations

import pytest
import stream_model as sm

from smp._C import schedule as ir


def _programs(schedule) -> list[list[str]]:
    return [[str(a) for a in program if a is not None] for program in schedule]


def _schedule(name: str, p: int, m: int):
    """(compute-only schedule, stage_to_rank) of a generator; interleaved with 2 chunks a rank."""
    if name == "interleaved":
        return ir.interleaved_1f1b(p, 2, m), ir.round_robin_stage_to_rank(2 * p, p)
    generate = {"gpipe": ir.gpipe, "1f1b": ir.one_f_one_b, "zbh1": ir.zero_bubble_h1}[name]
    return generate(p, m), list(range(p))


def _variants(schedule, stage_to_rank) -> dict[str, dict]:
    """The host orders a run of ``schedule`` may issue: receives posted as early as the headers
    can arrive, or just before their consumers; sends issued right after their producers or as
    late as the host allows; and the IR's own lowered order."""
    traces = sm.schedule_traces(_programs(schedule), stage_to_rank)
    lowered = ir.add_communication(schedule, stage_to_rank)
    return {
        "early receives": sm.place_receives(traces, "earliest"),
        "late receives": sm.place_receives(traces, "latest"),
        "late sends": sm.place_receives(sm.delay_sends(traces), "earliest"),
        "lowered": sm.schedule_traces(_programs(lowered), stage_to_rank),
    }


_CASES = [
    (name, p, m)
    for name in ("gpipe", "1f1b", "zbh1", "interleaved")
    for p in (2, 4)
    for m in (1, 2, 3, 4, 8)
    if name != "interleaved" or m % p == 0  # the generator's requirement
]


@pytest.mark.parametrize("name,p,m", _CASES)
def test_no_schedule_deadlocks_under_the_discipline(name, p, m):
    schedule, stage_to_rank = _schedule(name, p, m)
    num_stages = len(stage_to_rank)
    for variant, traces in _variants(schedule, stage_to_rank).items():
        graph = sm.build(traces, "new")
        # Every activation and gradient crosses ranks: the check is not vacuous.
        assert len(graph.pairs) == 2 * (num_stages - 1) * m, variant
        deadlock = sm.find_deadlock(graph)
        assert deadlock is None, f"{name} p={p} m={m}, {variant}: {deadlock}"


@pytest.mark.parametrize("name,p,m", [(n, p, m) for n, p, m in _CASES if m in (2, 8)])
def test_the_lowered_order_survives_even_the_old_discipline(name, p, m):
    """add_communication() issues every rank's sends and receives in one global order, which
    cannot deadlock under rendezvous sends (Note [Send/recv order]): the model agrees with the
    IR's validator even where compute waits on every send and receive at once."""
    schedule, stage_to_rank = _schedule(name, p, m)
    lowered = ir.add_communication(schedule, stage_to_rank)
    ir.validate_schedule(lowered, len(stage_to_rank), m, stage_to_rank)
    traces = sm.schedule_traces(_programs(lowered), stage_to_rank)
    assert sm.check(traces, "old") is None


@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("variant", ["early receives", "late receives", "late sends"])
def test_the_old_discipline_deadlocks_in_the_steady_state_of_1f1b(m, variant):
    """The discipline the stream rule replaces: compute waits for a receive where it is posted
    and for a send where it is issued, and c10d makes each NCCL op wait for all of compute.
    Posted early, rank 1's wait for the activation of microbatch 1 sits ahead of 1B0 on its
    compute stream, so the gradient of microbatch 0 waits for that activation, whose send waits
    for rank 0's compute, which already waits for that gradient (and sends issued late wait for
    even more of it). Posted late, each rank's compute waits for its own send before its
    receive is issued, whose NCCL stream waits for that compute (a send-send crossing)."""
    traces = _variants(*_schedule("1f1b", 2, m))[variant]
    deadlock = sm.check(traces, "old")
    assert deadlock is not None and deadlock.kind == "cycle", variant
    assert deadlock.ranks == {0, 1}, deadlock
    waits = [op for op in deadlock.ops if " compute[" in op and ": wait " in op]
    expected = "wait send" if variant == "late receives" else "wait recv"
    assert any(expected in op for op in waits), deadlock


def test_the_old_discipline_needs_a_steady_state_to_deadlock():
    """With one microbatch nothing crosses in both directions at once: no cycle, which shows the
    cycles above come from the steady state and not from the model."""
    for traces in _variants(*_schedule("1f1b", 2, 1)).values():
        assert sm.check(traces, "old") is None


def test_a_cycle_reads_as_ops():
    deadlock = sm.check(_variants(*_schedule("1f1b", 2, 4))["early receives"], "old")
    text = str(deadlock)
    assert text.startswith("cycle: rank ") and text.endswith("-> (the first)"), text
    assert "nccl 0->1" in text and "nccl 1->0" in text, text


# ---- hand-written orders -----------------------------------------------------------------------


def test_waiting_for_a_message_before_producing_the_one_it_depends_on_is_a_cycle():
    """Each rank's task consumes the other's message before producing its own: each compute
    stream waits for a receive whose send waits for the other compute stream. (A host could not
    run this either; the device graph shows why the streams could not.)"""
    traces = {
        0: [("recv", "b", 1), ("task", "A", ["b"], ["a"]), ("send", "a", 1)],
        1: [("recv", "a", 0), ("task", "B", ["a"], ["b"]), ("send", "b", 0)],
    }
    for discipline in ("new", "old"):
        deadlock = sm.check(traces, discipline)
        assert deadlock is not None and deadlock.kind == "cycle", discipline
        assert deadlock.ranks == {0, 1}
        assert any(op.endswith(": A") for op in deadlock.ops), deadlock
    with pytest.raises(ValueError, match="cannot run these traces"):
        sm.place_receives({r: [a for a in t if a[0] != "recv"] for r, t in traces.items()})


def test_a_consume_before_its_receive_is_rejected():
    """Under the rule, compute waits for an event the receiving thread records: a consume
    issued before that record would wait on nothing (CUDA treats an unrecorded event as done)."""
    traces = {
        0: [("task", "A", [], ["a"]), ("send", "a", 1)],
        1: [("task", "B", ["a"], []), ("recv", "a", 0)],
    }
    with pytest.raises(ValueError, match="consumes message 'a' before receiving it"):
        sm.build(traces, "new")
    with pytest.raises(ValueError, match="sends message 'a' before producing it"):
        sm.build({0: [("send", "a", 1), ("produce", "a")], 1: [("recv", "a", 0)]}, "new")
    with pytest.raises(ValueError, match="unknown trace action"):
        sm.build({0: [("wait", "a")]}, "new")


def test_an_unmatched_send_or_receive_is_a_deadlock():
    sent_only = {0: [("task", "A", [], ["a"]), ("send", "a", 1)], 1: [("compute", "B")]}
    deadlock = sm.check(sent_only, "new")
    assert deadlock is not None and deadlock.kind == "unmatched", deadlock
    assert deadlock.ops == ["rank 0 nccl 0->1[0]: send a"], deadlock
    received_only = {0: [("compute", "A")], 1: [("recv", "a", 0), ("task", "B", ["a"], [])]}
    deadlock = sm.check(received_only, "old")
    assert deadlock is not None and deadlock.kind == "unmatched", deadlock
    assert deadlock.ranks == {1}


def test_receives_posted_out_of_channel_order_are_mismatched():
    """NCCL matches a communicator's sends and receives in order: a receiver that posts the
    second message's receive first gets the first message in its buffer."""
    traces = {
        0: [("task", "A", [], ["a", "b"]), ("send", "a", 1), ("send", "b", 1)],
        1: [("recv", "b", 0), ("recv", "a", 0), ("task", "B", ["a", "b"], [])],
    }
    deadlock = sm.check(traces, "new")
    assert deadlock is not None and deadlock.kind == "mismatched", deadlock
    assert "send a is matched with rank 1 nccl 0->1[0]: recv b" in deadlock.ops[0], deadlock


def test_a_send_waits_for_its_producer_only_and_compute_for_a_receive_at_its_consumer():
    """The two halves of the rule, on one small order: rank 0 produces ``a`` in task P, then
    enqueues Q before its sending thread gets to the send; rank 1's receive of ``a`` is posted
    before its task R, which does not use it, and S consumes it."""
    traces = {
        0: [("task", "P", [], ["a"]), ("compute", "Q"), ("send", "a", 1)],
        1: [("recv", "a", 0), ("compute", "R"), ("task", "S", ["a"], [])],
    }
    new, old = sm.build(traces, "new"), sm.build(traces, "old")
    for graph in (new, old):
        send = graph.find(0, "nccl 0->1", "send a")
        assert graph.depends_on(send, graph.find(0, "compute", "P"))
    # The send waits for Q only under the old discipline (it waited for all of compute).
    assert not new.depends_on(new.find(0, "nccl 0->1", "send a"), new.find(0, "compute", "Q"))
    assert old.depends_on(old.find(0, "nccl 0->1", "send a"), old.find(0, "compute", "Q"))
    # R waits for the receive only under the old discipline; S under both.
    recv_new, recv_old = new.find(1, "nccl 0->1", "recv a"), old.find(1, "nccl 0->1", "recv a")
    assert not new.depends_on(new.find(1, "compute", "R"), recv_new)
    assert old.depends_on(old.find(1, "compute", "R"), recv_old)
    assert new.depends_on(new.find(1, "compute", "S"), recv_new)
    compute = [op.what for op in new.streams[(1, "compute")]]
    assert compute == ["R", "wait F(a)", "S"], compute


def test_earliest_receives_are_posted_as_soon_as_the_header_can_arrive():
    """1F1B at p = 2: rank 0 sends the activations of microbatches 0 and 1 before it needs
    anything from rank 1, so rank 1 may hold both headers before it starts; rank 0 may hold the
    gradient of microbatch 0 right after its first send, and a lowered receive sits where
    add_communication() put it."""
    schedule, stage_to_rank = _schedule("1f1b", 2, 4)
    variants = _variants(schedule, stage_to_rank)
    early = variants["early receives"]
    assert early[1][:3] == [("recv", "0F0", 0), ("recv", "0F1", 0), ("consume", "0F0")]
    assert early[0][:4] == [
        ("compute", "0F0"), ("produce", "0F0"), ("send", "0F0", 1), ("recv", "1B0", 1)
    ]  # fmt: skip
    late = variants["late receives"]
    assert late[1].index(("recv", "0F1", 0)) == late[1].index(("consume", "0F1")) - 1
    lowered = variants["lowered"][1]
    assert lowered[:2] == [("recv", "0F0", 0), ("task", "1F0", ["0F0"], [])], lowered


def test_schedule_traces_send_in_the_order_the_ir_lowers():
    """Per rank and peer, the traces send in the order of add_communication()'s SENDs (the
    channel order NCCL matches), for every generator."""
    for name, p, m in [("1f1b", 4, 8), ("zbh1", 4, 8), ("interleaved", 4, 8), ("gpipe", 2, 4)]:
        schedule, stage_to_rank = _schedule(name, p, m)
        traces = sm.schedule_traces(_programs(schedule), stage_to_rank)
        lowered = sm.schedule_traces(
            _programs(ir.add_communication(schedule, stage_to_rank)), stage_to_rank
        )
        for rank in traces:
            for peer in range(p):
                ours = [a[1] for a in traces[rank] if a[0] == "send" and a[2] == peer]
                theirs = [a[1] for a in lowered[rank] if a[0] == "send" and a[2] == peer]
                assert ours == theirs, (name, rank, peer)

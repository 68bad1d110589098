"""A model of how the pipeline runtime orders GPU work on streams, and a deadlock check.

design.md §4.8 (Device ordering) states the rule this model encodes; ``test_stream_discipline.py``
checks the schedule IR's programs with it and ``tests/python/distributed/test_stream_orders.py``
checks the orders the runtime really issues. Plain Python: nothing here needs smp or a GPU.

What a GPU does with work issued on streams, as modelled:
  - ops on one stream run in issue order, each starting after the one before completed;
  - an event recorded on a stream completes once everything issued on that stream before it has
    completed; an event wait on another stream blocks that stream until then;
  - c10d issues an NCCL point-to-point op on the NCCL stream of its communicator, after making
    that stream wait for the issuing thread's current stream (everything issued there so far);
    ``Work::wait()`` makes the waiting thread's current stream wait for the op;
  - there is one NCCL communicator per ordered pair of ranks (``pp_up`` from the lower to the
    higher rank, ``pp_down`` back; c10d makes a two-rank communicator per pair and group), so on
    the sender its stream holds only sends to that peer and on the receiver only receives from
    it. Sends and receives on one communicator match in FIFO order, and a matched send and
    receive complete only once both have started: each waits for the other's predecessors.

A deadlock is a cycle in the "must complete before" graph of these ops, or an NCCL op that nothing
matches (it never completes, and nor does anything behind it on its stream).

Host traces. Each rank's trace lists what its host threads issue, in issue order. Actions:
  ("task", name, consumes, produces)  sugar for the consumes, then the work, then the produces:
  ("consume", msg)    a task about to run takes message ``msg``'s tensors (hand-out);
  ("compute", name)   module work (forward, input or weight gradients) enqueued on the rank;
  ("produce", msg)    ``msg``'s tensors are complete: the producing thread queues the message;
  ("send", msg, peer) the sending thread issues ``msg``'s device payload to ``peer``;
  ("recv", msg, peer) the receiving thread posts the receive of ``msg`` from ``peer`` (as soon as
                      its header arrived: place_receives() puts these where they may fall).
Message ids are any hashable values, unique per step; a message crosses from the rank whose trace
sends it to the rank whose trace receives it.

The two disciplines (:func:`build`), C being the rank's compute stream (the device's default
stream, on which all module work runs):
  "new"  produce: record event E on C. send: on the send stream S_p of the peer, wait E, issue the
         NCCL send (its stream waits for S_p), wait for it on S_p. recv: issue the NCCL receive
         with the receive stream R_p of the peer current (its stream waits for R_p), wait for it
         on R_p, record event F on R_p. consume: C waits for F, just before the task's work.
  "old"  send: the NCCL stream waits for C (everything issued there so far), then the send, and
         C waits for the send. recv: the NCCL stream waits for C, then the receive, and C waits
         for the receive at once, ahead of the task that uses it. produce and consume: nothing.

Example:
    traces = {0: [("task", "0F0", [], ["a"]), ("send", "a", 1)],
              1: [("recv", "a", 0), ("task", "1F0", ["a"], [])]}
    check(traces, "new")   # None: no deadlock
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

__all__ = [
    "Deadlock",
    "Op",
    "StreamGraph",
    "build",
    "check",
    "delay_sends",
    "expand",
    "find_deadlock",
    "place_receives",
    "runtime_traces",
    "schedule_traces",
]

DISCIPLINES = ("new", "old")
COMPUTE = "compute"


def nccl_stream(src: int, dst: int) -> str:
    """The name of the NCCL stream of the communicator carrying ``src``'s messages to ``dst``."""
    return f"nccl {src}->{dst}"


@dataclasses.dataclass(eq=False)
class Op:
    """One op issued on a stream: ``what`` it does; ``after`` holds the ops of other streams it
    waits for (event waits); program order on its stream is implied by ``index``."""

    rank: int
    stream: str
    index: int
    what: str
    msg: Hashable | None = None
    after: list[Op] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return f"rank {self.rank} {self.stream}[{self.index}]: {self.what}"

    def __repr__(self) -> str:
        return self.name


@dataclasses.dataclass
class Deadlock:
    """Why the ops cannot all complete.

    kind: "cycle" (``ops``: the cycle, each op unable to complete before the one before it, the
    first after the last), "unmatched" (``ops``: NCCL ops no op of the peer matches) or
    "mismatched" (``ops``: a send and the receive FIFO matching pairs it with, of different
    messages: the payload would land in the wrong buffer)."""

    kind: str
    ops: list[str]
    ranks: frozenset[int]

    def __str__(self) -> str:
        if self.kind == "cycle":
            return "cycle: " + " -> ".join(self.ops) + " -> (the first)"
        return f"{self.kind}: " + "; ".join(self.ops)


@dataclasses.dataclass
class StreamGraph:
    """The ops of every stream of every rank, and the matched NCCL send/receive pairs."""

    streams: dict[tuple[int, str], list[Op]]
    pairs: list[tuple[Op, Op]]
    unmatched: list[Op]
    mismatched: list[tuple[Op, Op]]

    def ops(self) -> Iterable[Op]:
        for ops in self.streams.values():
            yield from ops

    def preds(self) -> dict[Op, list[Op]]:
        """Op -> the ops that must complete before it can: those it must start after (its stream
        predecessor and the ops it waits for), and for a matched send or receive also those the
        other side must start after (a rendezvous: neither completes before both started)."""
        start: dict[Op, list[Op]] = {}  # what must complete before an op can start
        for ops in self.streams.values():
            for i, op in enumerate(ops):
                start[op] = ([ops[i - 1]] if i else []) + list(op.after)
        preds = {op: list(before) for op, before in start.items()}
        for send, recv in self.pairs:
            preds[send].extend(start[recv])
            preds[recv].extend(start[send])
        return preds

    def depends_on(self, later: Op, earlier: Op) -> bool:
        """Whether ``later`` cannot complete before ``earlier`` has."""
        preds = self.preds()
        seen, todo = set(), [later]
        while todo:
            for p in preds[todo.pop()]:
                if p is earlier:
                    return True
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return False

    def find(self, rank: int, stream: str, what: str) -> Op:
        """The only op of ``rank``'s ``stream`` doing ``what``."""
        found = [op for op in self.streams.get((rank, stream), []) if op.what == what]
        if len(found) != 1:
            raise KeyError(f"{len(found)} ops '{what}' on rank {rank}'s {stream} stream")
        return found[0]


_ARITY = {"compute": 2, "consume": 2, "produce": 2, "send": 3, "recv": 3}


def expand(trace: Sequence[tuple]) -> list[tuple]:
    """A trace with every ("task", name, consumes, produces) written out as its consumes, its
    ("compute", name) and its produces. Raises ValueError on an unknown action."""
    out: list[tuple] = []
    for action in trace:
        kind = action[0]
        if kind == "task":
            _, name, consumes, produces = action
            out.extend(("consume", m) for m in consumes)
            out.append(("compute", name))
            out.extend(("produce", m) for m in produces)
        elif len(action) == _ARITY.get(kind):
            out.append(tuple(action))
        else:
            raise ValueError(
                f"unknown trace action {action!r}: expected ('task', name, consumes, produces), "
                "('compute', name), ('consume', msg), ('produce', msg), ('send', msg, peer) or "
                "('recv', msg, peer)"
            )
    return out


def _check_trace(traces: dict[int, list[tuple]]) -> None:
    """Raises ValueError where the traces cannot describe a run: a message produced, sent,
    received or consumed twice, sent before it was produced, sent by a rank that did not
    produce it, or consumed on a rank before (or without) its receive there. (A consume before
    its receive would wait on an event not yet recorded, which CUDA treats as already complete:
    a race, not an ordering.)"""
    seen: dict[tuple[str, Hashable], tuple[int, int]] = {}
    for rank, trace in traces.items():
        for i, action in enumerate(trace):
            kind, msg = action[0], action[1]
            if kind == "compute":
                continue
            if (kind, msg) in seen:
                raise ValueError(
                    f"message {msg!r} is {kind}d twice (rank {seen[(kind, msg)][0]} and rank "
                    f"{rank}): message ids must be unique per step"
                )
            seen[(kind, msg)] = (rank, i)
    for (kind, msg), (rank, i) in seen.items():
        if kind == "send":
            produced = seen.get(("produce", msg))
            if produced is None or produced[0] != rank or produced[1] > i:
                raise ValueError(
                    f"rank {rank} sends message {msg!r} before producing it (its trace must "
                    f"hold ('produce', {msg!r}) before the send)"
                )
        if kind == "consume":
            received = seen.get(("recv", msg))
            if received is None or received[0] != rank or received[1] > i:
                raise ValueError(
                    f"rank {rank} consumes message {msg!r} before receiving it (its trace must "
                    f"hold ('recv', {msg!r}, peer) before the consume: place_receives() adds them)"
                )


def build(traces: dict[int, Sequence[tuple]], discipline: str) -> StreamGraph:
    """The ops every rank issues for its host trace under ``discipline`` ("new" or "old"; the
    module docstring says what each does), with NCCL sends and receives matched in FIFO order
    per communicator. Raises ValueError on a malformed trace (see _check_trace)."""
    if discipline not in DISCIPLINES:
        raise ValueError(f"discipline {discipline!r}: expected one of {DISCIPLINES}")
    expanded = {rank: expand(trace) for rank, trace in traces.items()}
    _check_trace(expanded)
    streams: dict[tuple[int, str], list[Op]] = defaultdict(list)

    def issue(rank: int, stream: str, what: str, msg=None, after=()) -> Op:
        ops = streams[(rank, stream)]
        op = Op(rank, stream, len(ops), what, msg, [a for a in after if a is not None])
        ops.append(op)
        return op

    def mark(rank: int, stream: str) -> Op | None:
        """An event recorded on ``stream`` now (None if nothing was issued there yet)."""
        if not streams[(rank, stream)]:
            return None
        return issue(rank, stream, "record (c10d: the NCCL stream waits for this)")

    events: dict[Hashable, Op] = {}  # msg -> E (new: on C) or F (new: on R_p)
    for rank, trace in expanded.items():
        for action in trace:
            kind, msg = action[0], action[1]
            if kind == "compute":
                issue(rank, COMPUTE, str(msg))
            elif discipline == "new":
                if kind == "produce":
                    events[("E", msg)] = issue(rank, COMPUTE, f"record E({msg})", msg)
                elif kind == "send":
                    peer = action[2]
                    side = f"send to {peer}"
                    issue(rank, side, f"wait E({msg})", msg, [events[("E", msg)]])
                    sent = issue(
                        rank, nccl_stream(rank, peer), f"send {msg}", msg, [mark(rank, side)]
                    )
                    issue(rank, side, f"wait send {msg}", msg, [sent])
                elif kind == "recv":
                    peer = action[2]
                    side = f"recv from {peer}"
                    got = issue(
                        rank, nccl_stream(peer, rank), f"recv {msg}", msg, [mark(rank, side)]
                    )
                    issue(rank, side, f"wait recv {msg}", msg, [got])
                    events[("F", msg)] = issue(rank, side, f"record F({msg})", msg)
                elif kind == "consume":
                    issue(rank, COMPUTE, f"wait F({msg})", msg, [events[("F", msg)]])
            else:  # old
                if kind == "send":
                    peer = action[2]
                    sent = issue(
                        rank, nccl_stream(rank, peer), f"send {msg}", msg, [mark(rank, COMPUTE)]
                    )
                    issue(rank, COMPUTE, f"wait send {msg}", msg, [sent])
                elif kind == "recv":
                    peer = action[2]
                    got = issue(
                        rank, nccl_stream(peer, rank), f"recv {msg}", msg, [mark(rank, COMPUTE)]
                    )
                    issue(rank, COMPUTE, f"wait recv {msg}", msg, [got])
    pairs, unmatched, mismatched = [], [], []
    channels = sorted({stream for _, stream in streams if stream.startswith("nccl ")})
    for stream in channels:
        src, dst = map(int, stream[len("nccl ") :].split("->"))
        sends = [op for op in streams.get((src, stream), []) if op.what.startswith("send ")]
        recvs = [op for op in streams.get((dst, stream), []) if op.what.startswith("recv ")]
        for send, recv in zip(sends, recvs):
            pairs.append((send, recv))
            if send.msg != recv.msg:
                mismatched.append((send, recv))
        unmatched.extend(sends[len(recvs) :])
        unmatched.extend(recvs[len(sends) :])
    return StreamGraph(dict(streams), pairs, unmatched, mismatched)


def find_deadlock(graph: StreamGraph) -> Deadlock | None:
    """Unmatched or mismatched NCCL ops, else a cycle of ops none of which can complete (the
    first found, depth first); None if every op can complete."""
    if graph.unmatched:
        ops = graph.unmatched
        return Deadlock("unmatched", [op.name for op in ops], frozenset(op.rank for op in ops))
    if graph.mismatched:
        names = [f"{s.name} is matched with {r.name}" for s, r in graph.mismatched]
        ranks = frozenset(op.rank for pair in graph.mismatched for op in pair)
        return Deadlock("mismatched", names, ranks)
    preds = graph.preds()
    state: dict[Op, int] = {}  # 1: on the current path, 2: done (no cycle through it)
    for root in preds:
        if root in state:
            continue
        path: list[Op] = [root]
        its: list[Any] = [iter(preds[root])]
        state[root] = 1
        while path:
            nxt = next(its[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                its.pop()
            elif state.get(nxt) == 1:
                cycle = path[path.index(nxt) :]
                cycle.reverse()  # each op waits for the one before it
                return Deadlock(
                    "cycle", [op.name for op in cycle], frozenset(op.rank for op in cycle)
                )
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                its.append(iter(preds[nxt]))
    return None


def check(traces: dict[int, Sequence[tuple]], discipline: str) -> Deadlock | None:
    """find_deadlock(build(traces, discipline))."""
    return find_deadlock(build(traces, discipline))


def _sends(expanded: dict[int, list[tuple]]) -> dict[Hashable, tuple[int, int]]:
    """msg -> (sender, receiver) of every message some trace sends."""
    return {a[1]: (rank, a[2]) for rank, t in expanded.items() for a in t if a[0] == "send"}


def place_receives(traces: dict[int, Sequence[tuple]], at: str = "earliest") -> dict[int, list]:
    """The traces (expanded) with a ("recv", msg, sender) on the receiver for every message sent:
    where the receiving thread may post it, in FIFO order per sender.

    at="earliest": right after the last action of the receiver that the send's issue depends on
    through the host (its own earlier actions, and the sends of the messages consumed before
    them): the header arrived while the receiver's host was as far behind as it can be. This
    is the adversarial placement for the "old" discipline, whose compute stream waits for a
    receive where it is posted.
    at="latest": just before the receiver consumes it, or a later message from the same sender
    (FIFO), or at the end of its trace if it never does.

    Raises ValueError if the traces already hold receives, or if the hosts cannot run them (a
    rank consumes a message no trace sends, or the consumes wait on each other in a circle)."""
    if at not in ("earliest", "latest"):
        raise ValueError(f"at={at!r}: expected 'earliest' or 'latest'")
    expanded = {rank: expand(trace) for rank, trace in traces.items()}
    if any(a[0] == "recv" for t in expanded.values() for a in t):
        raise ValueError("the traces already hold receives; place_receives() adds all of them")
    route = _sends(expanded)
    order = {r: [a[1] for a in t if a[0] == "send"] for r, t in expanded.items()}
    seq = {m: i for msgs in order.values() for i, m in enumerate(msgs)}
    where: dict[Hashable, int] = {}  # msg -> index in the receiver's trace to insert before
    if at == "latest":
        for msg, (src, dst) in route.items():
            trace = expanded.get(dst, [])
            later = {
                m for m in order[src][seq[msg] :] if route[m][1] == dst
            }  # it and the messages after it on its channel
            hits = [i for i, a in enumerate(trace) if a[0] == "consume" and a[1] in later]
            where[msg] = min(hits, default=len(trace))
    else:
        sent_clock = _host_clocks(expanded, route)
        for msg, (_, dst) in route.items():
            where[msg] = sent_clock[msg].get(dst, 0)
    out: dict[int, list] = {}
    for rank in sorted(set(expanded) | {dst for _, dst in route.values()}):
        trace = expanded.get(rank, [])
        mine = sorted((where[m], src, seq[m], m) for m, (src, dst) in route.items() if dst == rank)
        merged, k = [], 0
        for i, action in enumerate(trace):
            while k < len(mine) and mine[k][0] <= i:
                merged.append(("recv", mine[k][3], mine[k][1]))
                k += 1
            merged.append(action)
        merged.extend(("recv", m, src) for _, src, _, m in mine[k:])
        out[rank] = merged
    return out


def _host_clocks(
    expanded: dict[int, list[tuple]], route: dict[Hashable, tuple[int, int]]
) -> dict[Hashable, dict[int, int]]:
    """For each message, the vector clock of its send's issue: rank -> how many of that rank's
    actions come before it through the host (program order, and a consume after the send of
    its message). Raises ValueError if the hosts cannot get through their traces."""
    clock = {rank: defaultdict(int) for rank in expanded}
    pos = dict.fromkeys(expanded, 0)
    sent: dict[Hashable, dict[int, int]] = {}
    moved = True
    while moved:
        moved = False
        for rank, trace in expanded.items():
            while pos[rank] < len(trace):
                kind, msg = trace[pos[rank]][:2]
                if kind == "consume":
                    if msg not in sent:
                        break
                    for r, n in sent[msg].items():
                        clock[rank][r] = max(clock[rank][r], n)
                clock[rank][rank] = pos[rank] + 1
                if kind == "send":
                    sent[msg] = dict(clock[rank])
                pos[rank] += 1
                moved = True
    stuck = {r: expanded[r][p] for r, p in pos.items() if p < len(expanded[r])}
    if stuck:
        waits = "; ".join(
            f"rank {r} at {a!r}" + ("" if a[1] in route else " (no trace sends it)")
            for r, a in stuck.items()
        )
        raise ValueError(f"the hosts cannot run these traces: {waits}")
    return sent


# ---- adapters: the schedule IR's programs and the runtime's recorded orders -------------------

_ACTION = re.compile(r"^(\d+)(F|B|I|W|SEND_F|SEND_B|RECV_F|RECV_B)(\d+)$")


def schedule_traces(programs: Sequence[Sequence[str]], stage_to_rank: Sequence[int]) -> dict:
    """Host traces for schedule IR programs: ``programs[r]`` is rank r's actions in order, as the
    IR's strings ("1F0", "1I0", "1W0", "0SEND_F1", "1RECV_F1"), stage s on rank
    ``stage_to_rank[s]``. F of (s, m) consumes the activation of F(s-1, m) and produces its own
    for stage s+1; B or I of (s, m) consumes the gradient of the B or I of (s+1, m) and produces
    its own for stage s-1; W crosses nothing. Only messages between different ranks travel; each
    is named by the action that produces it ("0F1": the activation 0F1 computed).

    A compute-only schedule (the generators') gives traces without receives (place_receives()
    adds them), each send issued at once after its producer. A lowered one (add_communication())
    issues each send at its SEND and posts each receive at its RECV."""
    num_stages = len(stage_to_rank)
    parsed: dict[str, tuple[int, str, int]] = {}
    backward_input: dict[tuple[int, int], str] = {}
    for rank, program in enumerate(programs):
        for text in program:
            m = _ACTION.match(text)
            if not m:
                raise ValueError(f"rank {rank}: {text!r} is not a schedule IR action")
            stage, kind, mb = int(m[1]), m[2], int(m[3])
            if not 0 <= stage < num_stages or stage_to_rank[stage] != rank:
                raise ValueError(f"action {text} on rank {rank}: stage {stage} is not there")
            parsed[text] = (stage, kind, mb)
            if kind in ("B", "I"):
                backward_input[(stage, mb)] = text
    lowered = any("_" in kind for _, kind, _ in parsed.values())
    traces: dict[int, list] = {}
    for rank, program in enumerate(programs):
        trace: list = []
        for text in program:
            stage, kind, mb = parsed[text]
            if kind == "SEND_F":
                trace.append(("send", f"{stage}F{mb}", stage_to_rank[stage + 1]))
            elif kind == "SEND_B":
                trace.append(("send", backward_input[(stage, mb)], stage_to_rank[stage - 1]))
            elif kind == "RECV_F":
                trace.append(("recv", f"{stage - 1}F{mb}", stage_to_rank[stage - 1]))
            elif kind == "RECV_B":
                trace.append(("recv", backward_input[(stage + 1, mb)], stage_to_rank[stage + 1]))
            else:
                consumes, produces = [], []
                if kind == "F":
                    if stage > 0 and stage_to_rank[stage - 1] != rank:
                        consumes.append(f"{stage - 1}F{mb}")
                    if stage < num_stages - 1 and stage_to_rank[stage + 1] != rank:
                        produces.append((text, stage_to_rank[stage + 1]))
                elif kind in ("B", "I"):
                    if stage < num_stages - 1 and stage_to_rank[stage + 1] != rank:
                        consumes.append(backward_input[(stage + 1, mb)])
                    if stage > 0 and stage_to_rank[stage - 1] != rank:
                        produces.append((text, stage_to_rank[stage - 1]))
                trace.append(("task", text, consumes, [msg for msg, _ in produces]))
                if not lowered:
                    trace.extend(("send", msg, peer) for msg, peer in produces)
        traces[rank] = trace
    return traces


def delay_sends(traces: dict[int, Sequence[tuple]]) -> dict[int, list]:
    """The traces (expanded) with every send issued as late as its rank's host allows: just
    before the rank's next consume (a sending thread that only catches up when the compute
    thread waits for input), or at the end. Sends keep their order."""
    out: dict[int, list] = {}
    for rank, trace in traces.items():
        merged, held = [], []
        for action in expand(trace):
            if action[0] == "send":
                held.append(action)
                continue
            if action[0] == "consume":
                merged.extend(held)
                held = []
            merged.append(action)
        out[rank] = merged + held
    return out


def runtime_traces(
    logs: dict[int, Sequence[tuple]],
    carries_device_tensors: Callable[[tuple, int], bool],
    receives: str = "latest",
) -> dict[int, list]:
    """Host traces, receives placed, from what each rank's runtime did in one step, in order:
      ("begin", kind, microbatch)  a recorded span starts ("F", "B", "W"; spans nest: an open
                                   span's work resumes at the inner span's end);
      ("end",)                     the innermost open span ends;
      ("send", peer, header, n)    a message with n tensors is queued for ``peer``;
      ("take", peer, header, n)    the message from ``peer`` is handed to the task run next
                                   (inside an open span: to that span's worker, which goes
                                   on with it).
    Only messages for which ``carries_device_tensors(header, n)`` holds travel on the NCCL
    streams; the k-th such message from a to b with a given header is the k-th taken by b from a
    with that header (channels are FIFO). Each message is produced and sent where it is queued
    (the task goes on after it). Receives are placed by place_receives(traces, ``receives``):
    where the receiving thread posts one does not matter under "new", which orders nothing on
    C before the hand-out, but both placements are real. Raises ValueError if a rank takes a
    message no rank logged sending."""
    sent: dict[tuple[int, int], str] = {}  # (rank, index in its log) -> message id
    channels: dict[tuple[int, int], dict[tuple, deque]] = defaultdict(lambda: defaultdict(deque))
    for rank, log in logs.items():
        counts: dict[int, int] = defaultdict(int)
        for i, event in enumerate(log):
            if event[0] == "send" and carries_device_tensors(event[2], event[3]):
                peer, header = event[1], tuple(event[2])
                msg = f"{rank}->{peer} #{counts[peer]} {list(header[:3])}"
                counts[peer] += 1
                sent[(rank, i)] = msg
                channels[(rank, peer)][header].append(msg)
    traces: dict[int, list] = {}
    for rank, log in logs.items():
        trace: list = []
        stack: list[str] = []
        for i, event in enumerate(log):
            kind = event[0]
            if kind == "begin":
                stack.append(f"{rank}{event[1]}{event[2]}")
                trace.append(("compute", stack[-1]))
            elif kind == "end":
                stack.pop()
                if stack:
                    trace.append(("compute", stack[-1]))
            elif kind == "send" and (rank, i) in sent:
                trace.extend([("produce", sent[(rank, i)]), ("send", sent[(rank, i)], event[1])])
                if stack:  # the task goes on after queueing it
                    trace.append(("compute", stack[-1]))
            elif kind == "take" and carries_device_tensors(event[2], event[3]):
                peer, header = event[1], tuple(event[2])
                queue = channels[(peer, rank)].get(header)
                if not queue:
                    raise ValueError(
                        f"rank {rank} took a message from {peer} with header {list(header)} "
                        "that no log has it send"
                    )
                trace.append(("consume", queue.popleft()))
                if stack:  # a worker that took its own reply goes on (Note [Direct resumes])
                    trace.append(("compute", stack[-1]))
            elif kind not in ("send", "take"):
                raise ValueError(f"rank {rank}: unknown log event {event!r}")
        traces[rank] = trace
    return place_receives(traces, at=receives)

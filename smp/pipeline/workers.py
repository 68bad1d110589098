"""What runs a pipeline step's Python code: workers, the threads they run in, and the baton.

A worker (:class:`_Worker`) is one forward in a thread of its own: the leader's step function
for one microbatch, or a call this stage serves. Exactly one runs Python at a time: the server
thread (``PipelineRuntime.run_step``, smp.pipeline.runtime) hands it the baton (:class:`_Baton`)
and waits for it back, when the worker finishes or suspends to wait for another stage. A worker
keeps what its backward needs: its remote calls (:class:`_Call`), which cut its forward into
intervals, and the inputs it fetched from a third stage (:class:`_PeerFetch`).

Also here: the threads workers run in, kept across steps (:class:`_Threads`); each worker's
random stream (:class:`_Streams`, design.md §4.7); and the timeline of what ran when
(:class:`_Recorder`).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from smp.pipeline import segments
from smp.pipeline.context import CallMode

_SLICE = -1  # the call id of a worker's local interval boundary (no remote call)
_JOIN_S = 5.0  # how long _Threads.close() waits for its parked threads to end, in all


class _Abort(BaseException):
    """Raised inside a suspended worker when the step is aborted (not an Exception on purpose)."""


@dataclasses.dataclass
class _Call:
    """A remote call made by a worker: what backward needs to know about it."""

    call_id: int
    owner: int
    worker: Any
    grad: bool  # made with grad mode on: backward crosses it (GRAD_OUT, maybe GRAD_IN)
    sent: list[torch.Tensor]  # sent tensors that require grad, in slot order
    sent_edges: list[Any]  # their gradient edges
    path: str = ""
    key: tuple | None = None  # (module index, request structure, grad): its output prediction
    predicted: bytes | None = None  # the output structure the caller continued with (async)
    values: list[torch.Tensor] | None = None  # the outputs, once REPLY has arrived
    out_leaves: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)
    grad_in: list[torch.Tensor | None] | None = None
    structure: Any = None  # the REPLY's skeleton, unpickled
    push: bool = True  # the REPLY carries the outputs (else they are fetched when used)
    used: bool = False  # an output was resolved here (not only passed on by reference)
    fetch_of: _Call | None = None  # a FETCH: the call whose outputs it brings
    fetch: _Call | None = None  # the FETCH sent for this call's outputs
    quiet: bool = False  # no REPLY or GRAD_IN comes unless it went otherwise (Note [Quiet calls])
    flags: tuple[bool, ...] = ()  # the predicted outputs' requires_grad flags
    # model.backward's gradients for its outputs taken as roots before they arrived, (slot,
    # gradient or None for ones): Note [Backward from futures]
    root_grads: list[tuple[int, torch.Tensor | None]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _PeerFetch:
    """A served call's input that the caller passed by reference to an output of a third stage:
    fetched from that stage, whose call gets this input's gradient back (design.md §4.8)."""

    worker: Any  # the served call that takes it
    index: int  # its position among the served call's input values
    stage: int  # the stage that computed it
    fetch_id: int
    out_slot: int
    values: list  # the served call's input values, filled in place
    leaf: torch.Tensor | None = None


@dataclasses.dataclass
class _ArgumentFetch:
    """A FETCH of an argument tensor that a served call's caller kept (Note [Arguments fetched
    when read] in smp.pipeline.calls): the served call waits for ``value``."""

    worker: Any
    fetch_id: int
    value: torch.Tensor | None = None


# ``_current.worker``: the worker this thread runs (None outside one).
_current = threading.local()


class _Baton:
    """A counting semaphore for the baton's hand-offs between the server loop and its workers
    (two per piece a worker runs: the grant and the return).

    ``threading.Semaphore`` is written in Python over a Condition, which allocates a lock per
    wait and runs a dozen bytecodes under contention: one grant-and-return cost ~125 us between
    two threads here against ~47 us for this, a ``queue.SimpleQueue`` (C, one lock and a
    counter), with the same counting semantics (benchmarks/README.md, "Where a call's time
    goes").
    """

    __slots__ = ("_queue",)

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def release(self) -> None:
        self._queue.put(None)

    def acquire(self, timeout: float | None = None) -> bool:
        """Takes one release, waiting up to ``timeout`` seconds (None: for ever); False if none
        came by then."""
        try:
            self._queue.get(timeout=timeout)
        except queue.Empty:
            return False
        return True


class _Worker:
    """A forward running in its own thread: the step function (leader) or a served call.
    ``runtime``: the ``PipelineRuntime`` (smp.pipeline.runtime) whose step it runs in."""

    def __init__(self, runtime, microbatch: int, target: Callable[[], Any], worker_id: int):
        self.id = worker_id
        self.runtime = runtime
        self.microbatch = microbatch
        self.target = target
        self.go = _Baton()
        # The baton goes back through its step's semaphore: a worker that outlived its step (it
        # hung past timeout_s) cannot hand a baton to the next step.
        self.back: _Baton = runtime._back
        self.finished = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.error_text = ""
        self.aborted = False
        # backward bookkeeping
        self.starts: list[int] = []
        self.calls: list[_Call] = []
        self.boundary: dict[int, torch.Tensor] = {}  # id -> fresh leaf (served inputs, replies)
        self.pending: list[dict] = []  # per interval: edge key -> (edge, grad)
        self.leaf_grads: dict[int, torch.Tensor] = {}
        self.uses: segments.Uses | None = None  # shared by its segments while backward runs
        self.next_interval = -1  # next interval whose backward runs (-1: backward not started)
        self.backward_done = False
        self.served: tuple[int, int] | None = None  # (caller stage, call id) for served calls
        self.module_path: str | None = None  # the module a served call runs
        self.input_leaves: list[tuple[int, torch.Tensor]] = []  # served: (slot, leaf)
        self.out_tensors: list[torch.Tensor] = []  # served: every output tensor, slot order
        self.sent_ids: dict[int, int] = {}  # served: id of a request tensor -> its slot
        self.received: dict[int, torch.Tensor] = {}  # served: request slot -> tensor it brought
        self.out_grads_acc: dict[int, torch.Tensor] = {}  # served: output slot -> gradient
        self.ones_slots: list[int] = []  # served: output slots whose gradient is ones (GRAD_OUT)
        self.awaiting = 0  # served: gradient deliveries missing (GRAD_OUT, consumers' shares)
        # grad mode: the step thread's (served: and the caller's, from REQUEST)
        self.grad = runtime.step_context.mode.grad
        self.mode: CallMode | None = None  # served: the caller's thread state (REQUEST)
        self.backward_started = False
        self.completed = False  # served: GRAD_IN sent
        # served: a quiet call (Note [Quiet calls]): the predicted output structure's digest,
        # and whether the caller has been told that the call went otherwise
        self.quiet = False
        self.quiet_digest = 0
        self.quiet_refused = False
        self.replied = False  # served: REPLY sent (its outputs are known)
        self.push = True  # served: the REPLY carries the outputs
        self.skeleton: torch.Tensor | None = None  # served: the outputs' skeleton
        # served: FETCHes waiting for its outputs, (stage, REPLY header, output slot or -1)
        self.fetches: list[tuple[int, list[int], int]] = []
        self.ref_inputs: list[tuple[int, _Worker, int]] = []  # (value index, producer, slot)
        self.ref_leaves: list[tuple[_Worker, int, torch.Tensor]] = []  # (producer, slot, leaf)
        self.peer_inputs: list[_PeerFetch] = []  # served: inputs fetched from a third stage
        self.fetches_due = 0  # served: of those, not arrived yet
        # served: arguments its caller kept, fetched when read: (request slot, leaf, version)
        self.fetched_arguments: list[tuple[int, torch.Tensor, int]] = []
        self.deferred: list[_Worker] = []  # served calls waiting for this one's outputs
        self.waiting: _Call | None = None  # the call whose REPLY this suspended worker awaits
        self.resuming = False  # processing its own REPLY in its thread (Note [Direct resumes])
        self.resumes = 0  # times it did (the server's bound on it restarts at each)
        self.replies_due = 0  # calls whose REPLY has not arrived
        self.acks_due = 0  # calls whose GRAD_IN has not arrived
        self.started = False  # handed to a thread (it may not have been granted yet)
        # Its own random stream (design.md §4.7): the default generators hold this state while
        # it runs, so what it draws does not depend on the order the stages' tasks ran in.
        self.rng_key = 0
        self.rng_states: list[torch.Tensor] | None = None
        self.calls_made = 0  # remote calls it made: the keys of their served workers' streams

    def run(self, park: Callable[[], None]) -> None:
        """The worker's life, in a pool thread: waits for its first grant, runs ``target``,
        and ``park``s the thread (ready for another worker) before the baton goes back."""
        self.go.acquire()
        _current.worker = self
        mode = dataclasses.replace(self.mode or self.runtime.step_context.mode, grad=self.grad)
        try:
            if self.aborted:
                raise _Abort()
            with self.runtime.step_context.applied(mode):
                self.new_interval()
                self.result = self.target()
        except _Abort:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported through the server
            self.error = exc
            self.error_text = "".join(traceback.format_exception(exc))
        finally:
            _current.worker = None
            self.finished = True
            park()
            self.back.release()

    def release(self) -> None:
        """Drops everything this worker holds, once its step is over (``_forget_step``)."""
        self.target = self.result = self.error = self.waiting = self.skeleton = None
        self.calls, self.boundary, self.pending, self.leaf_grads = [], {}, [], {}
        self.input_leaves, self.out_tensors, self.out_grads_acc = [], [], {}
        self.sent_ids, self.received = {}, {}
        self.fetches, self.ref_inputs, self.ref_leaves, self.peer_inputs = [], [], [], []
        self.deferred, self.fetched_arguments = [], []

    def suspend(self) -> None:
        """Gives the baton back to the server and waits to be resumed."""
        if self.aborted:  # its step is over (it ran past the baton's bound): nothing resumes it
            raise _Abort()
        self.back.release()
        self.go.acquire()
        if self.aborted:
            raise _Abort()

    def describe(self) -> str:
        """What this worker runs, for messages: "microbatch 2's step function" or "microbatch 2's
        call of module 'blocks.3' (from stage 0)"."""
        if self.served is None:
            return f"microbatch {self.microbatch}'s step function"
        return (
            f"microbatch {self.microbatch}'s call of module '{self.module_path}' "
            f"(from stage {self.served[0]})"
        )

    def wait_for(self, call: _Call) -> None:
        """Suspends until ``call``'s REPLY has arrived (the server grants this worker then), or
        takes that REPLY itself (Note [Direct resumes] in smp.pipeline.runtime)."""
        self.waiting = call
        if self.aborted:
            raise _Abort()
        if self.runtime.resume_directly(self):
            return
        self.suspend()

    def new_interval(self) -> None:
        self.starts.append(segments.mark())
        self.pending.append({})

    def maybe_slice(self) -> None:
        """Before a large local module's forward: ends the current interval there (when it has
        any autograd node), so its backward is a separate task (design.md §4.4)."""
        if self.next_interval != -1 or not self.grad or not torch.is_grad_enabled():
            return  # not in this worker's forward (a recomputation in backward), or no graph
        if segments.mark() == self.starts[-1]:
            return  # nothing recorded since the interval started
        self.calls.append(_Call(_SLICE, self.runtime.stage, self, False, [], []))
        self.new_interval()

    def interval_of(self, node) -> int:
        seq = node._sequence_nr()
        index = 0
        for i, start in enumerate(self.starts):
            if start <= seq:
                index = i
        return index


class _Threads:
    """The threads workers run in, kept across steps.

    A thread per worker (one per microbatch and per served call) made every step create dozens
    of threads, and glibc gives a new thread a malloc arena whose memory goes back to the
    system as the thread's allocations are freed; the next worker's activations then fault in
    fresh pages. On the p = 2 benchmark that was 3-4x torch's page faults per step and forward
    pieces ~10 % slower (benchmarks/README.md). A thread here runs one worker at a time and
    parks itself when the worker finishes; at most as many exist as workers were alive at once.
    """

    def __init__(self):
        self.lock = threading.Lock()
        # parked threads: (inbox, a queue.SimpleQueue of workers; the thread)
        self.idle: list[tuple[Any, threading.Thread]] = []
        self.count = 0
        self.closed = False

    def run(self, worker: _Worker) -> None:
        with self.lock:
            inbox = self.idle.pop()[0] if self.idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            self.count += 1
            name = f"smp-worker{self.count}"
            threading.Thread(target=self._serve, args=(inbox,), daemon=True, name=name).start()
        worker.started = True
        inbox.put(worker)

    def _serve(self, inbox) -> None:
        while (worker := inbox.get()) is not None:
            worker.run(lambda: self._park(inbox))
            worker = None  # a parked thread holds nothing of the step it ran

    def _park(self, inbox) -> None:
        with self.lock:
            if self.closed:
                inbox.put(None)  # closed while this thread ran a worker: it ends now
            else:
                self.idle.append((inbox, threading.current_thread()))

    def close(self) -> None:
        """Ends every thread: parked ones now, busy ones when their worker finishes."""
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
        for inbox, _ in idle:
            inbox.put(None)
        # Parked threads end at once: wait for them (briefly), so that a released runtime's
        # threads are gone when close() returns. Not the calling thread (a collection may run
        # the finalizer on a pool thread).
        deadline = time.monotonic() + _JOIN_S
        for _, thread in idle:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


_MASK = (1 << 63) - 1


def _mix(key: int, value: int) -> int:
    """A new stream key from ``key`` and ``value`` (splitmix64's finaliser; non-negative int64)."""
    z = (key * 0x9E3779B97F4A7C15 + value + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK


class _Streams:
    """Per-worker random streams for a step (design.md §4.7).

    The workers of a step share the default generators (CPU, and the current CUDA device's),
    and which worker runs when depends on timing: dropout in a pipelined step drew different
    numbers from run to run. Each worker has a stream of its own instead, seeded from a key that
    names it the same way in every run: the leader's microbatch m has ``mix(base, m)``, where
    ``base`` is one draw from the leader's generator per step (so steps differ and a seeded run
    repeats; every rank draws it, so ranks seeded alike stay alike); the k-th remote call a
    worker makes is served with ``mix(its key, k)`` (sent with the REQUEST). While a worker runs
    (between the baton's grant and its return) the default generators hold its stream's state;
    around the step they hold their own, moved on by that one draw.
    """

    def __init__(self):
        self.generators = [torch.default_generator]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.generators.append(torch.cuda.default_generators[torch.cuda.current_device()])
        # Drawn on every rank, used on the leader: each rank's generator moves on by one draw
        # per step, so ranks seeded alike stay alike (a script drawing its data from it).
        self.base = int(torch.randint(0, _MASK, (), dtype=torch.int64))
        self.saved = [g.get_state() for g in self.generators]

    def enter(self, worker: _Worker) -> None:
        if worker.rng_states is None:
            for g in self.generators:
                g.manual_seed(worker.rng_key)
        else:
            for g, state in zip(self.generators, worker.rng_states):
                g.set_state(state)

    def leave(self, worker: _Worker) -> None:
        worker.rng_states = [g.get_state() for g in self.generators]

    def close(self) -> None:
        for g, state in zip(self.generators, self.saved):
            g.set_state(state)


class _Recorder:
    """What this rank ran in a step: (type, microbatch, start, end) spans, wall-clock seconds.

    ``begin`` while a span is open closes the open span's current segment and resumes it at the
    matching ``end`` (a microbatch's backward called from its forward splits that forward in
    two), so recorded spans never overlap. Only one thread runs at a time (the baton), so no lock.
    """

    def __init__(self):
        self.offset = time.time() - time.perf_counter()
        self.spans: list[tuple[str, int, float, float]] = []
        self.stack: list[list] = []

    def begin(self, kind: str, microbatch: int) -> None:
        now = time.perf_counter() + self.offset
        if self.stack:
            self._close_segment(now)
        self.stack.append([kind, microbatch, now])

    def _close_segment(self, now: float) -> None:
        """Records the open span's current segment, up to ``now`` (none if it is paused)."""
        top = self.stack[-1]
        if top[2] is not None and now > top[2]:
            self.spans.append((top[0], top[1], top[2], now))

    def end(self) -> None:
        now = time.perf_counter() + self.offset
        kind, microbatch, start = self.stack.pop()
        if start is not None:  # not paused
            self.spans.append((kind, microbatch, start, now))
        if self.stack:
            self.stack[-1][2] = now

    def pause(self) -> None:
        """Closes the open span's current segment: its owner waits (it holds the baton meanwhile,
        Note [Direct resumes]). ``resume`` opens a new one; ``end`` closes a paused span."""
        self._close_segment(time.perf_counter() + self.offset)
        self.stack[-1][2] = None

    def resume(self) -> None:
        self.stack[-1][2] = time.perf_counter() + self.offset

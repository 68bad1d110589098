"""The module server: runs one step of a partitioned model across pipeline stages (design.md §4).

Every pipeline rank runs :meth:`PipelineRuntime.run_step`. The leader (pp rank 0) runs the user's
step function once per microbatch, each in a worker thread; a call to a module owned by another
stage goes through a stub that sends REQUEST to the owner and suspends the worker until REPLY.
The owner serves the call in a worker thread of its own (whose forward may call other stages,
including the caller's). Exactly one worker runs Python at a time: the server thread hands a
baton to the task the policy (``smp._C.ServerPolicy``) picks, and waits for it back.

Backward is event driven (``smp.pipeline.segments``): each worker's forward is cut into intervals
at its remote calls; intervals run backward in reverse order as their gradients become complete,
in the server thread; gradients cross stages as GRAD_OUT (caller → owner, gradients of a call's
outputs) and GRAD_IN (owner → caller, gradients of its inputs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from torch import nn

from smp import _C
from smp.core import messages, tree
from smp.memory import activations, offload
from smp.pipeline import segments
from smp.pipeline.cache import LRU
from smp.pipeline.context import CallMode, StepContext
from smp.pipeline.sender import Sender
from smp.state import State

__all__ = ["CallStructureChanged", "PipelineRuntime"]

logger = logging.getLogger("smp")

REQUEST, REPLY, GRAD_OUT, GRAD_IN, ERROR, STEP_END = range(1, 7)
_QUIET = 2  # a REQUEST's flag (header[5], beside "push"): Note [Quiet calls]
_FETCH = -1  # the module index of a REQUEST that asks for an earlier call's outputs
_SLICE = -1  # the call id of a worker's local interval boundary (no remote call)
_BATON_WAITS = 2  # the server waits this many timeout_s at most for a worker to yield
_SLICES_PER_STAGE = 8  # a module with this fraction of its stage's cost starts a backward slice


def _fetch_header(mb: int, fetch_id: int, grad: bool, caller: int, call_id: int, slot: int):
    """A FETCH: outputs of the call ``call_id`` that the receiver served for ``caller`` (-1: the
    sender), all of them (``slot`` -1) or one; ``grad``: its gradient will come back."""
    return [REQUEST, mb, fetch_id, _FETCH, int(grad), 1, 1, 0, caller, call_id, slot]


_ORDER_END, _ORDER_ABORT = -1, -2  # TP task order: the step is over / TP rank 0 failed
_TAG = 0x5E7


def _fresh_tag(state: State) -> int:
    """A transport tag no other runtime of this process has used since ``smp.init``. Every
    pipelined model's runtimes share the process groups; a failed step leaves its tag's
    channels unusable (a message never received, a receive still posted), so a tag is never
    used twice: not by the next step of the same model, and not by another model. Every rank
    creates runtimes and fails steps in the same order, so the ranks draw the same tags."""
    counter = state.__dict__.setdefault("_smp_pipeline_tags", itertools.count(_TAG))
    return next(counter)


# Note [Quiet calls]
# A call of the step function that returns futures at once (its output structure predicted), whose
# outputs stay on the owner (not pushed), whose arguments need no gradient back or got none back
# from the last answered call with the same key (the next layer of a chain on one stage: its input
# is the last layer's output, held there, and an HF cache holds other layers' keys and values,
# which it does not read) and whose module's last answered call called no other stage (a flag of
# the REPLY) is *quiet*: the owner sends neither REPLY nor GRAD_IN for it, the caller waits for
# neither, and only the REQUEST and the caller's GRAD_OUT travel. The REQUEST carries the digest
# of the structure the caller continued with. Otherwise a REPLY says what an asynchronous call's
# owner knows once its forward has run: the structure (checked against the prediction) and that
# nothing else happened; a GRAD_IN without gradients only says that its backward is done. On the
# HF Llama of benchmarks/pipeline_hf_llama.py 7 of the 9 calls of a microbatch are quiet (layers 6
# and 7, the norm, the head, three of the loss's four ops on the logits): 22 messages instead of
# 36, and the leader's backward waits once, not thrice.
# - The owner answers a quiet call only when it went otherwise: outputs of another structure (a
#   REPLY with the skeleton), gradients for its arguments (a GRAD_IN), or a call to another stage
#   (an empty REPLY, before that call is sent: the caller may be at the end of its step, no longer
#   serving). The caller then raises CallStructureChanged, wherever it is in the step (its loop or
#   _await_stage_ends), and the step runs again (smp.step) with that module's calls answered
#   (``loud``). So a quiet call never calls another stage: its backward sends nothing back either.
# - Nobody waits for its end, so the stage serving it does not leave the step while it has one
#   whose forward is not done, or whose backward its caller has begun (GRAD_OUT arrived) and is
#   not done (PipelineServer.hold_open). What such a call waits for is on its way: its inputs, its
#   consumers' gradients, from the caller (its GRAD_OUTs precede its STEP_END) or from this or a
#   third stage (each stage finishes its calls before it leaves).
# - The leader's microbatch may finish before a quiet call's backward; the schedule only sees its
#   microbatches' end earlier, the step's end still waits for every stage's STEP_END.
# Not from a served call (whose REPLY must mean that every call it made is done) nor with TP (no
# predictions there).


# Note [Backward from futures]
# The leader's ``model.backward(loss)`` takes its roots as they are: a root that is an output of
# one of this microbatch's calls whose value has not arrived (the loss of an HF causal LM,
# computed on the head's stage by ops on futures) is not waited for. Its gradient (the one
# given, or ones, which the owner builds from the output) goes with that call's GRAD_OUT, which
# the backward sends at once: the last stage starts a microbatch's backward when its forward is
# done, as in torch's schedules, not after a round trip to the leader, which is by then busy
# with another microbatch's forward. A root that the prediction says needs no gradient is
# resolved, and raises as torch would.


class CallStructureChanged(RuntimeError):
    """A module returned outputs of another structure than its earlier calls with the same
    arguments, after the caller had continued with the predicted structure (design.md §4c).
    ``smp.step`` runs such a step again when it can restore what the attempt changed; the
    module's calls wait for their outputs from then on (its key is never predicted again)."""


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
    fetched from that stage, whose call gets this input's gradient back (design.md §4d)."""

    worker: Any  # the served call that takes it
    index: int  # its position among the served call's input values
    stage: int  # the stage that computed it
    fetch_id: int
    out_slot: int
    values: list  # the served call's input values, filled in place
    leaf: torch.Tensor | None = None


class _Future(torch.Tensor):
    """An output of an asynchronous remote call (design.md §4c) before or after it arrives.

    Any use as a tensor (an op, a method, a property such as ``.shape``) waits for the value and
    then runs on it; passed to another call of the module's owner, it travels as a reference and
    the owner uses the value it already holds.
    """

    @staticmethod
    def __new__(cls, call: _Call, slot: int):
        future = torch.Tensor._make_subclass(cls, _EMPTY, False)
        future._smp_call, future._smp_slot = call, slot
        return future

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GET:  # where the value would land: no need to fetch it
            return _future_device(args[0])
        remote = _maybe_remote_op(func, args, kwargs)
        if remote is not _LOCAL:
            return remote
        args, kwargs = _resolve_tree((args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents=None):
        return repr(self._smp_value())

    def _smp_value(self) -> torch.Tensor:
        call: _Call = self._smp_call
        call.used = True
        if call.values is None:
            worker = getattr(_current, "worker", None)
            if worker is not call.worker:
                raise RuntimeError(
                    f"smp: the output of module '{call.path}' (pipeline stage {call.owner}) was "
                    "used outside the step function's microbatch that called it, before it arrived"
                )
            worker.runtime._await_values(call)
        return call.values[self._smp_slot]


# A future's own storage: empty, and on the meta device, so code that bypasses
# __torch_function__ (a C++ extension bound with pybind) fails loudly instead of reading it.
_EMPTY = torch.empty(0, device="meta")

# Note [Ops on futures run where the value is]
# An op whose tensor operands are futures of one other stage, plus tensors small enough to
# send, runs on that stage (as a call of its _RemoteOps module, so autograd, predictions, FETCH
# and failures are a module call's) and returns futures: with a model's logits, which the root
# turns into a loss (Hugging Face's `model(..., labels=...)`), the logits stay where the head
# ran, and only the loss comes back, its gradient goes out. Only the functional ops below
# (casts, views, reductions, losses, arithmetic) do: nothing in place, nothing random, nothing
# that returns a non-tensor. Any other use of a future fetches its value, as before.
_DEVICE_GET = torch.Tensor.device.__get__
_LOCAL = object()
_SMALL_OPERANDS = 64 * 1024  # bytes of the other operands an op may send with it
_F = torch.nn.functional
_T = torch.Tensor
_REMOTE_OPS = frozenset(
    {
        *(_T.float, _T.double, _T.half, _T.bfloat16, _T.contiguous, _T.clone),
        *(_T.view, _T.reshape, _T.flatten, _T.__getitem__, _T.transpose, _T.permute),
        *(_T.squeeze, _T.unsqueeze, _T.sum, _T.mean, torch.sum, torch.mean),
        *(_T.__add__, _T.__radd__, _T.__sub__, _T.__rsub__, _T.__mul__, _T.__rmul__),
        *(_T.__truediv__, _T.__neg__, _T.log_softmax, _T.softmax),
        *(_F.cross_entropy, _F.nll_loss, _F.log_softmax, _F.softmax, _F.mse_loss, _F.l1_loss),
        *(_F.binary_cross_entropy_with_logits, _F.kl_div),
    }
)


# Note [Tensors sent once]
# A Hugging Face decoder's root passes one DynamicCache to every layer; each call to a layer on
# another stage carried the keys and values of every earlier layer again (1.3 MiB per call by
# layer 7 of the benchmark's Llama), and the rotary cos/sin and the mask went with every call
# too. A stage now remembers, per owner and microbatch, each tensor its requests sent (a weak
# reference to it, its version counter, call id and slot). The same tensor, unchanged since
# (same object, same version), travels to that owner again as a Ref to the earlier request's
# slot (messages.INPUT) and no bytes. The owner keeps each served call's request tensors until
# the step ends (as it kept their leaves) and gives the new call its own leaf over the same
# data: the gradient of that leaf goes back with the new call's GRAD_IN, as if the tensor had
# been sent again, so nothing about backward changes. Only within a microbatch: requests of
# one microbatch are served in the order they were sent (as for output references), those of
# different microbatches may not be. A served module that changes such an input in place
# under no_grad changes what a later call of the same stage sees, as one process would.


class _RemoteOps(nn.Module):
    """Runs an op on this stage for another stage's call (Note [Ops on futures run where the
    value is]): one per stage, outside the model."""

    def forward(self, func, *args, **kwargs):
        return func(*args, **kwargs)


def _future_device(future: _Future) -> torch.device:
    return future._smp_call.worker.runtime.state.device


def _maybe_remote_op(func, args, kwargs):
    """The futures of an op run on their stage (Note [Ops on futures run where the value is]),
    or ``_LOCAL``."""
    if func not in _REMOTE_OPS or "out" in kwargs:
        return _LOCAL
    worker = getattr(_current, "worker", None)
    if worker is None or not worker.runtime.forward_direct:
        return _LOCAL
    owner, small = None, 0
    for leaf in tree.flatten((args, kwargs))[0]:
        if isinstance(leaf, _Future):
            call = leaf._smp_call
            if call.worker is not worker or call.values is not None:
                return _LOCAL  # another microbatch's, or here already
            if owner not in (None, call.owner):
                return _LOCAL
            owner = call.owner
        elif isinstance(leaf, torch.Tensor):
            small += leaf.numel() * leaf.element_size()
            if small > _SMALL_OPERANDS:
                return _LOCAL
    if owner is None or owner == worker.runtime.stage:
        return _LOCAL
    runtime = worker.runtime
    return runtime._remote_call(worker, owner, runtime.ops_index[owner], (func, *args), kwargs)


def _resolve_module_args(module, args):
    """Global forward pre-hook during a pipelined step: a local module's positional arguments
    are resolved before its forward (its code may call C++ extensions directly), and a large
    module's forward starts a new backward slice (``_Worker.maybe_slice``)."""
    worker = getattr(_current, "worker", None)
    if worker is not None and id(module) in worker.runtime.slice_before:
        worker.maybe_slice()
    if any(isinstance(a, (_Future, list, tuple, MutableMapping)) for a in args):
        resolved = _resolve_in_place(args, set())
        return None if resolved is args else resolved
    return None


def _resolve_in_place(value, seen: set):
    """``value`` with every future replaced by its value. Lists and dicts change in place and
    stay the caller's objects (a module may append to a list it is given, as in one process);
    tuples are rebuilt only where they held a future; other objects are kept."""
    if isinstance(value, _Future):
        return value._smp_value()
    if isinstance(value, (list, MutableMapping, tuple)):
        if id(value) in seen:
            return value
        seen.add(id(value))
    if isinstance(value, list):
        for i, item in enumerate(value):
            new = _resolve_in_place(item, seen)
            if new is not item:
                value[i] = new
    elif isinstance(value, MutableMapping):
        for key, item in list(value.items()):
            new = _resolve_in_place(item, seen)
            if new is not item:
                value[key] = new
    elif isinstance(value, tuple):
        items = [_resolve_in_place(item, seen) for item in value]
        if any(new is not old for new, old in zip(items, value)):
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _resolve(value):
    return value._smp_value() if isinstance(value, _Future) else value


def _resolve_tree(value):
    """``value`` with every future replaced by its value (objects other than containers kept)."""
    return tree.map_tensors(_resolve, value)


def _resolve_results(value):
    """A step function's or served call's results with every future replaced by its value,
    inside any object too (a cache, a dataclass: rebuilt, smp.core.tree's ``objects``)."""
    return tree.map_tensors(_resolve, value, objects=True)


def _call_and_note_changes(module: nn.Module, args: tuple, kwargs: dict, values: list, worker):
    """Runs a served call. Returns (outputs, changed, written): the arguments whose state the
    forward changed (a cache it appended to), as ``[(position or keyword, value)]``, and the
    request tensors whose data it changed in place (their version counter moved), as
    ``[(request slot, new data)]``, for the caller to take over (design.md §4i). Notes on
    ``worker`` which tensors came with the request, so that a tensor handed back unchanged
    travels as a reference to the caller's own (``messages.Sent``)."""
    watched = [*enumerate(args), *kwargs.items()]
    before = [(where, v, messages.fingerprint(v)) for where, v in watched]
    versions = [v._version if isinstance(v, torch.Tensor) else None for v in values]
    output = activations.call(
        module, args, kwargs, (worker.mode.checkpoint, worker.mode.preserve_rng)
    )
    changed = [(w, v) for w, v, fp in before if fp is not None and messages.fingerprint(v) != fp]
    written = [
        (slot, value)
        for slot, (value, version) in enumerate(zip(values, versions))
        if version is not None and value._version != version
    ]
    worker.sent_ids = {id(v): i for i, v in enumerate(values) if isinstance(v, torch.Tensor)}
    return output, changed, [(slot, _written_back(worker, slot, t)) for slot, t in written]


def _written_back(worker, slot: int, tensor: torch.Tensor) -> torch.Tensor:
    """The new data of request tensor ``slot``, which the served forward changed in place, to
    go back to the caller (a copy: the tensor itself would travel as the caller's own, Sent).

    Raises:
        messages.WriteBackError: the change cannot be carried back exactly: autograd recorded it
            (the caller's tensor would need this stage's graph), or the tensor was fetched from
            a third stage (whose copy would stay as it was).
    """
    what = (
        f"argument tensor {slot} (shape {tuple(tensor.shape)}) of module "
        f"'{worker.module_path}' (microbatch {worker.microbatch})"
    )
    if tensor.grad_fn is not None:
        raise messages.WriteBackError(
            f"smp: the forward changed {what} in place with autograd recording it; the caller, "
            "on another pipeline stage, cannot take that change with its gradient. Change a "
            "copy (x = x.clone() first) and return it, or make the change under torch.no_grad()"
        )
    if any(fetch.index == slot for fetch in worker.peer_inputs):
        raise messages.WriteBackError(
            f"smp: the forward changed {what} in place, an output of a third pipeline stage "
            "passed on by reference, which that stage would not see. Change a copy "
            "(x = x.clone() first) and return it"
        )
    new = tensor.detach().clone()
    for index, producer, out_slot in worker.ref_inputs:
        if index != slot:
            continue
        # An output of a call this stage served, passed by reference: in one process it is that
        # output which changed, so later references and FETCHes take the new data. The output
        # is replaced, not written to: a REPLY may still be sending it (Sender's rule).
        if producer.out_tensors[out_slot].requires_grad:
            raise messages.WriteBackError(
                f"smp: the forward changed {what} in place, an output of module "
                f"'{producer.module_path}' that takes part in backward; the change cannot "
                "reach that output's other users. Change a copy (x = x.clone() first)"
            )
        producer.out_tensors[out_slot] = new
    return new


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
    """A forward running in its own thread: the step function (leader) or a served call."""

    def __init__(
        self, runtime: PipelineRuntime, microbatch: int, target: Callable[[], Any], worker_id: int
    ):
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
        self.deferred: list[_Worker] = []  # served calls waiting for this one's outputs
        self.waiting: _Call | None = None  # the call whose REPLY this suspended worker awaits
        self.replies_due = 0  # calls whose REPLY has not arrived
        self.acks_due = 0  # calls whose GRAD_IN has not arrived
        self.started = False  # handed to a thread (it may not have been granted yet)
        # Its own random stream (design.md §4j): the default generators hold this state while
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
        self.deferred = []

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
        """Suspends until ``call``'s REPLY has arrived (the server grants this worker then)."""
        self.waiting = call
        self.suspend()

    def new_interval(self) -> None:
        self.starts.append(segments.mark())
        self.pending.append({})

    def maybe_slice(self) -> None:
        """Before a large local module's forward: ends the current interval there (when it has
        any autograd node), so its backward is a separate task (design.md §4e)."""
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
        self.idle: list[Any] = []  # inboxes (queue.SimpleQueue) of parked threads
        self.count = 0
        self.closed = False

    def run(self, worker: _Worker) -> None:
        with self.lock:
            inbox = self.idle.pop() if self.idle else None
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
                self.idle.append(inbox)

    def close(self) -> None:
        """Ends every thread: parked ones now, busy ones when their worker finishes."""
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
        for inbox in idle:
            inbox.put(None)


_current = threading.local()
_remote_classes: dict[type, type] = {}


def _remote_call_dunder(self, *args, **kwargs):
    runtime_ref, path, owner = self._smp_remote
    runtime = runtime_ref()
    if runtime is None:
        raise RuntimeError(
            f"smp: module '{path}' belongs to a pipelined model that no longer exists (it lives "
            f"on pipeline stage {owner}); keep the smp.DistributedModel while its modules run"
        )
    return runtime._call_remote_module(path, owner, args, kwargs)


def _remote_class(cls: type) -> type:
    """``cls`` with ``__call__`` sending the call to the module's owner (cached per class)."""
    if cls not in _remote_classes:
        _remote_classes[cls] = type(
            f"Remote{cls.__name__}",
            (cls,),
            {"__call__": _remote_call_dunder, "__module__": cls.__module__},
        )
    return _remote_classes[cls]


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
            top = self.stack[-1]
            if now > top[2]:
                self.spans.append((top[0], top[1], top[2], now))
        self.stack.append([kind, microbatch, now])

    def end(self) -> None:
        now = time.perf_counter() + self.offset
        kind, microbatch, start = self.stack.pop()
        self.spans.append((kind, microbatch, start, now))
        if self.stack:
            self.stack[-1][2] = now


_MASK = (1 << 63) - 1


def _mix(key: int, value: int) -> int:
    """A new stream key from ``key`` and ``value`` (splitmix64's finaliser; non-negative int64)."""
    z = (key * 0x9E3779B97F4A7C15 + value + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK


class _Streams:
    """Per-worker random streams for a step (design.md §4j).

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


class _Held:
    """A runtime's transports and worker threads, released by :meth:`release` (idempotent):
    by ``close`` or, when a pipelined model is dropped without it, by the runtime's
    finalizer."""

    def __init__(self):
        self.transport = None
        self.order_transport = None
        self.threads = _Threads()

    def release(self) -> None:
        self.threads.close()
        transport, self.transport = self.transport, None
        order, self.order_transport = self.order_transport, None
        for t in (transport, order):
            if t is not None:
                t.abort()


class PipelineRuntime:
    """Runs steps of a partitioned model; one per DistributedModel with pp > 1."""

    # A tensor goes to an owner once per microbatch (Note [Tensors sent once]).
    send_once = True

    def __init__(
        self,
        state: State,
        module: nn.Module,
        assignment: dict[str, int],
        costs: dict[str, float] | None = None,
    ):
        self.state = state
        self.stage = state.axis_rank("pp")
        self.num_stages = state.axis_size("pp")
        self.module = module
        self.paths = [path for path, _ in module.named_modules()]
        self.model_paths = len(self.paths)  # the model's; the stages' _RemoteOps follow
        self.modules = dict(module.named_modules())
        self.assignment = dict(assignment)
        self.ops_index = []  # stage -> index of its _RemoteOps
        for stage in range(self.num_stages):
            path = f"<ops of stage {stage}>"
            self.ops_index.append(len(self.paths))
            self.paths.append(path)
            self.modules[path] = _RemoteOps()
            self.assignment[path] = stage
        self.module_ids = {id(m): path for path, m in self.modules.items()}  # travel by path
        self.index_of = {path: i for i, path in enumerate(self.paths)}
        self._tag = _fresh_tag(state)
        # What must be released with the runtime: kept apart from it, so that a finalizer can
        # release them when the runtime is collected (it must not reference the runtime).
        self._held = _Held()
        self.transport = self._new_transport()
        # With tensor parallelism, the TP ranks of a stage must run their tasks in one order (the
        # modules' TP collectives are matched by order): TP rank 0 picks, the others follow.
        self.order_group = state.groups.get("tp_order")
        self.order_leader = state.axis_rank("tp") == 0
        self.order_transport = self._new_order_transport()
        self._stash: dict[tuple, Any] = {}
        self.timeout_s = float(state.config.timeout_s)
        self._call_ids = itertools.count()
        self.async_calls = bool(getattr(state.config, "pipeline_async_calls", True))
        # An output of one stage passed to a call on another goes there directly (not with TP:
        # the TP ranks of a stage order their tasks through TP rank 0's, keyed by call ids).
        self.forward_direct = self.async_calls and self.order_group is None
        # Output structures of earlier calls: (module index, argument structure, grad) ->
        # (bytes, skeleton). Kept across steps; a key whose outputs changed is never predicted.
        self.predictions = LRU()  # (bounded: smp/pipeline/cache.py)
        self.reruns = 0  # steps run again after a call's output structure changed (smp.step)
        # Whether the caller used (resolved) a key's outputs the last time it finished a worker.
        self.push_outputs = LRU()
        self.unstable = LRU()  # keys never predicted again (while they stay in the table)
        self.loud = LRU()  # keys whose calls are answered again (Note [Quiet calls])
        # Whether the last GRAD_IN of a key's call that sent tensors requiring grad brought any
        # of their gradients (a call that sent some but got none back may be quiet).
        self.grads_back = LRU()
        self.threads = self._held.threads
        # Zero-bubble split (design.md §4g): stages other than the leader's compute a served
        # call's input gradients first and its weight gradients when idle. Not with TP (its
        # ranks must run the same tasks, and weight tasks fill idle time).
        splits = self.stage != 0 and self.order_group is None
        deferred = int(getattr(state.config, "deferred_weight_microbatches", 0) or 0)
        # "static" (design.md §4h): this stage's program orders its work; it places weight
        # halves itself (only zero-bubble programs have W actions).
        self.program: list[str] = []
        if state.config.pipeline == "static":
            self.program = _program(
                state.config.pipeline_schedule,
                self.num_stages,
                state.config.microbatches,
                self.stage,
            )
            has_weights = any("W" in action for action in self.program)
            deferred = state.config.microbatches if has_weights else 0
        self.deferred_weights = deferred if splits else 0  # the policy's limit on this rank
        self.split_weights = self.deferred_weights > 0
        # Only the step's last microbatches split (all of them under a program, which places
        # every W itself): earlier weight halves have no idle time to fill, and a split
        # backward costs more than a whole one (design.md §4g).
        self.split_from = 0 if self.program else state.config.microbatches - self.deferred_weights
        # Not with TP either: its ranks must run the same tasks, slices included. Not where
        # served calls are split: a served call's backward is then one segment, so all of its
        # weight gradients can wait.
        self.slice_before = (
            self._slice_modules(costs or {})
            if self.forward_direct and not self.split_weights
            else set()
        )
        self._install_stubs()
        state.runtimes.append(self)  # weakly (state.py): the model owns its runtime
        self._finalizer = weakref.finalize(self, self._held.release)

    # The transports live in ``_held`` (see __init__); fresh_transports replaces them there.
    transport = property(
        lambda self: self._held.transport, lambda self, t: setattr(self._held, "transport", t)
    )
    order_transport = property(
        lambda self: self._held.order_transport,
        lambda self, t: setattr(self._held, "order_transport", t),
    )

    def close(self) -> None:
        """Releases the transports and everything that keeps them (and so their process group)
        alive, and ends the worker threads. Called by smp.shutdown() before the groups are
        destroyed, and when the runtime is collected with its model. A transport left to the
        interpreter's final garbage collection would destroy its group in an arbitrary order
        ('terminate called without an active exception' at exit)."""
        self.policy = None  # a view into the server
        self.server = None  # keeps the transport alive (pybind keep_alive)
        self.workers = {}
        self._finalizer()  # releases _held, once

    def cache_sizes(self) -> dict[str, int]:
        """Entries in each call-structure table (bounded: smp/pipeline/cache.py), their common
        ``limit`` and how many entries they have ``evicted`` in all."""
        tables = {
            "predictions": self.predictions,
            "push_outputs": self.push_outputs,
            "unstable": self.unstable,
        }
        sizes = {name: len(table) for name, table in tables.items()}
        sizes["limit"] = self.predictions.limit
        sizes["evicted"] = sum(table.evicted for table in tables.values())
        return sizes

    def _new_order_transport(self):
        if self.order_group is None:
            return None
        n = self.state.axis_size("tp")
        peers = list(range(1, n)) if self.order_leader else [0]
        return _C.Transport(
            self.order_group,
            peers,
            float(self.state.config.timeout_s),
            self._tag,
            device=self.state.device,
        )

    def _new_transport(self):
        """Headers (and host tensors) on the pipeline group's host side; device tensors on the
        payload groups where there are some (NCCL; design.md §4k), else staged through the
        host. Received device tensors land on this rank's device."""
        peers = [s for s in range(self.num_stages) if s != self.stage]
        return _C.Transport(
            self.state.host_group("pp"),
            peers,
            float(self.state.config.timeout_s),
            self._tag,
            self.state.pipeline_payload_groups(),
            self.state.device,
        )

    def _slice_modules(self, costs: dict[str, float]) -> set[int]:
        """Ids of the local modules whose forward starts a new backward slice: every module
        whose subtree runs on this stage only and costs at least 1/_SLICES_PER_STAGE of the
        stage (``costs``: each module's own share of the model's cost, from the partitioner),
        unless it is inside another such module with a forward of its own (design.md §4e:
        a block's boundary, not its MLP's). Deterministic, unlike a clock, so a step's
        gradients do not depend on timing."""
        paths = self.paths[: self.model_paths]
        own = {path: float(costs.get(path, 0.0)) for path in paths}
        total = dict(own)
        elsewhere = {path: self.assignment[path] != self.stage for path in paths}
        for path in reversed(paths):  # named_modules is pre-order: children first here
            parent = path.rpartition(".")[0]
            if path and parent in total:
                total[parent] += total[path]
                elsewhere[parent] |= elsewhere[path]
        stage_cost = sum(own[p] for p in paths if self.assignment[p] == self.stage)
        floor = stage_cost / _SLICES_PER_STAGE
        large = {
            path
            for path in paths
            if path and not elsewhere[path] and total[path] > 0 and total[path] >= floor
        }
        # A slice inside a block cuts its residual stream twice (once directly, once through
        # the norm in front of the sliced module): the later slice then runs the norm's nodes
        # too (absorbed, segments.py). Containers that only hold their children (a ModuleList)
        # or chain them (Sequential) leave their children's boundaries clean.
        blocks = {
            path
            for path in large
            if not isinstance(self.modules[path], (nn.Sequential, nn.ModuleList, nn.ModuleDict))
        }

        def inside_block(path: str) -> bool:
            parent = path.rpartition(".")[0]
            while parent:
                if parent in blocks:
                    return True
                parent = parent.rpartition(".")[0]
            return False

        return {id(self.modules[path]) for path in large if not inside_block(path)}

    # ---- stubs ---------------------------------------------------------------------------------

    def _install_stubs(self) -> None:
        """Modules owned by other stages get a class whose ``__call__`` is a remote call.

        Replacing ``__call__`` (not ``forward``) keeps the module's hooks off the caller: they
        run once, on the owner, around the real forward.
        """
        for path, module in self.modules.items():
            owner = self.assignment[path]
            if owner != self.stage:
                # Weakly: the model's modules must not keep its runtime (threads, transports)
                # alive once the model is gone.
                object.__setattr__(module, "_smp_remote", (weakref.ref(self), path, owner))
                module.__class__ = _remote_class(type(module))

    def _call_remote_module(self, path: str, owner: int, args, kwargs):
        worker: _Worker | None = getattr(_current, "worker", None)
        if worker is None:
            raise RuntimeError(
                f"smp: module '{path}' lives on pipeline stage {owner}; call the model inside "
                "an @smp.step function"
            )
        return self._remote_call(worker, owner, self.index_of[path], args, kwargs)

    def _remote_call(self, worker: _Worker, owner: int, index: int, args, kwargs):
        """Sends REQUEST to ``owner``. A call of the leader's step function whose output
        structure is known (an earlier call with the same module and argument structure) returns
        futures at once (design.md §4c); any other call suspends the worker until REPLY."""
        if worker.aborted:  # its step is over (it ran past the baton's bound): it must not send
            raise _Abort()
        if worker.quiet and not worker.quiet_refused:
            self._refuse_quiet(worker)  # nobody waits for its end: the caller must run again
        call_id = next(self._call_ids)

        originals: list = []  # what the reply's Sent markers name (the caller's own tensors)
        # Tensors this stage sent the owner before in this microbatch, unchanged since: the
        # owner still holds them (Note [Tensors sent once]).
        held = self.sent_inputs.setdefault((owner, worker.microbatch), {})
        again: dict[int, torch.Tensor] = {}  # slot -> such a tensor, sent as a reference

        def resolve(tensor):
            originals.append(tensor)
            if isinstance(tensor, _Future):
                call = tensor._smp_call
                if call.worker.runtime is self:
                    if call.owner == owner:
                        return messages.Ref(call.call_id, tensor._smp_slot)
                    if self.forward_direct and call.values is None:
                        return messages.Ref(call.call_id, tensor._smp_slot, call.owner)
                tensor = tensor._smp_value()
            before = held.get(id(tensor)) if self.send_once else None
            if before is not None and before[0]() is tensor and before[1] == tensor._version:
                again[len(originals) - 1] = tensor
                return messages.Ref(before[2], before[3], messages.INPUT, tensor.requires_grad)
            return tensor

        unpacked, skeleton, tensors = messages.pack_parts((args, kwargs), resolve, self.module_ids)
        refs = [(i, t) for i, t in enumerate(tensors) if isinstance(t, messages.Ref)]
        real = [t for t in tensors if not isinstance(t, messages.Ref)]
        if self.send_once:
            for i, t in enumerate(tensors):
                # (An inference tensor keeps no version counter: it is sent every time.)
                if not isinstance(t, messages.Ref) and not t.is_inference():
                    held[id(t)] = (weakref.ref(t), t._version, call_id, i)
        mode = CallMode.current()
        grad = mode.grad
        # The owner's input leaves, in slot order: what it sends and what it already holds.
        inputs = [
            again.get(i, t)
            for i, t in enumerate(tensors)
            if i in again or not isinstance(t, messages.Ref)
        ]
        sent = [t for t in inputs if t.requires_grad] if grad else []
        path = self.paths[index] or "<root>"
        call = _Call(call_id, owner, worker, grad, sent, [segments.edge_of(t) for t in sent], path)
        worker.calls.append(call)
        prediction = None
        quiet = False
        # With tensor parallelism every decision here must be the same on every TP rank of the
        # stage (they run one task order, design.md §6a), but their arguments may differ (a
        # padding mask on one rank, None on another; smp/tp/region.py), and with them the keys,
        # predictions and FETCHes of their calls. So calls wait for their outputs there.
        if self.async_calls and self.order_group is None:
            call.key = (index, unpacked.blob, grad)
            prediction = self.predictions.get(call.key)
            # Outputs only passed on by reference last time need not come back (FETCH if used).
            call.push = prediction is None or self.push_outputs.get(call.key, True)
            # Note [Quiet calls]: nothing comes back that the step function could wait for.
            quiet = (
                prediction is not None
                and prediction[3]  # its last call called no other stage
                and not call.push
                and (not sent or self.grads_back.get(call.key) is False)
                and worker.served is None
                and call.key not in self.loud
            )
        flags = int(call.push) | _QUIET * quiet
        header = [REQUEST, worker.microbatch, call_id, index, mode.encode(), flags, len(refs)]
        for slot, ref in refs:
            header += [slot, ref.stage, ref.call_id, ref.slot]
        worker.calls_made += 1
        header.append(_mix(worker.rng_key, worker.calls_made))  # the served call's stream
        if quiet:
            header.append(prediction[2])  # the digest of the structure it continues with
            call.quiet = True
            self.quiet_calls[call_id] = call
        self._expect_reply(call, call_id, worker.microbatch)  # a quiet call's, if it goes otherwise
        # The arguments belong to the caller's code, which may modify them in place once this
        # returns: the message carries copies (cheaper than waiting for the peer to take it).
        payload = [t.detach().clone() for t in real]
        self.sender.send(owner, header, [skeleton, *payload])
        worker.new_interval()
        worker.replies_due += not quiet
        if prediction is None:  # synchronous: wait for the outputs
            call.used = True  # handed to the caller's code as they are
            worker.wait_for(call)
            reply = messages.fill(call.structure, call.values, self.modules, originals)
        else:
            call.predicted, predicted = prediction[:2]
            call.flags = predicted.flags
            futures = [_Future(call, i) for i in range(len(predicted.flags))]
            reply = messages.fill(predicted, futures, self.modules, originals)
        result, changed, written = reply
        for where, value in changed:  # arguments the module changed, as the owner left them
            what = f"argument {where!r} of module '{path}' (pipeline stage {owner})"
            messages.assign(args[where] if isinstance(where, int) else kwargs[where], value, what)
        for slot, value in written:  # argument tensors it changed in place
            self._write_back(owner, path, originals[slot], value)
        return result

    @staticmethod
    def _write_back(owner: int, path: str, original: torch.Tensor, value: torch.Tensor) -> None:
        """Gives the caller's tensor ``original`` the data that the module on stage ``owner``
        left in its copy of it, as one process would have changed it (design.md §4i)."""
        if isinstance(original, _Future):
            # Its value here, as the REPLY that brought it or a FETCH of the owner's (replaced)
            # output has it: a REPLY sent before the change carries the old data.
            original = original._smp_value()
        value = _resolve(value)
        if original.shape != value.shape or original.dtype != value.dtype:
            raise messages.WriteBackError(
                f"smp: module '{path}' (pipeline stage {owner}) changed an argument tensor in "
                f"place from {tuple(original.shape)} {original.dtype} to {tuple(value.shape)} "
                f"{value.dtype}; that cannot be written back into the caller's tensor. Return "
                "the new tensor from the module instead"
            )
        with torch.no_grad():
            original.copy_(value)

    def _await_values(self, call: _Call) -> None:
        """In ``call``'s worker: suspends until its outputs are here, fetching them from the
        owner if its REPLY does not bring them."""
        worker = call.worker
        if not call.push and call.fetch is None:
            fetch_id = next(self._call_ids)
            call.fetch = _Call(fetch_id, call.owner, worker, False, [], [], call.path)
            call.fetch.fetch_of = call
            self._expect_reply(call.fetch, fetch_id, worker.microbatch)
            worker.replies_due += 1
            header = _fetch_header(worker.microbatch, fetch_id, False, -1, call.call_id, -1)
            self.sender.send(call.owner, header, [])
        worker.wait_for(call.fetch or call)

    def _expect_reply(self, call: _Call | _PeerFetch, call_id: int, microbatch: int) -> None:
        """Registers the REPLY to ``call_id`` (a call or a FETCH) as a RESUME task for ``call``."""
        task_id = self.server.new_id()
        self.reply_tasks[task_id] = call
        self.server.expect(call_id, _C.TaskKind.RESUME, microbatch, task_id)

    def _reply_arrived(self, call: _Call, message) -> None:
        """A REPLY: the call's outputs enter the caller's graph as boundary leaves."""
        if isinstance(call, _PeerFetch):
            self._peer_input_arrived(call, message)
            return
        worker = call.worker
        if call.quiet:
            self._quiet_answered(call, message[2][0] if message[2] else None)
        skeleton, tensors = message[2][0], message[2][1:]
        if call.fetch_of is not None:  # the outputs of an earlier call, fetched
            self._take_outputs(call.fetch_of, messages.Skeleton.of(skeleton), tensors)
            self._replied(worker, call)
            return
        cleared = messages.Skeleton.of(skeleton)
        key = cleared.blob
        if call.predicted is not None and key != call.predicted:
            self._structure_changed(call, cleared)
        if call.key is not None and call.key not in self.unstable:
            # (structure, skeleton, its digest, whether the call called no other stage)
            self.predictions[call.key] = (key, cleared, messages.digest(key), message[1][3] == 1)
        call.structure = cleared
        if call.push:
            self._take_outputs(call, cleared, tensors)
        self._replied(worker, call)

    def _structure_changed(self, call: _Call, cleared: messages.Skeleton) -> None:
        """Raises CallStructureChanged: ``call`` returned ``cleared``, not what was predicted."""
        self.unstable.add(call.key)
        self.predictions.pop(call.key, None)
        raise CallStructureChanged(
            f"smp: module '{call.path}' (pipeline stage {call.owner}) returned "
            f"{messages.describe(cleared)}, but its earlier calls with the same arguments "
            f"returned {messages.describe(messages.Skeleton(call.predicted, ()))}, and "
            "the step function had continued with that (asynchronous pipeline calls, "
            "design.md §4c). "
            "The module's calls wait for their outputs from now on; "
            '"pipeline_async_calls": False makes every call wait.'
        )

    def _quiet_answered(
        self, call: _Call, skeleton: torch.Tensor | None, gradients: bool = False
    ) -> None:
        """A quiet call's owner answered (Note [Quiet calls]): the call went otherwise than the
        step function had assumed. Raises CallStructureChanged; the step runs again, with the
        module's calls answered from then on."""
        self.loud.add(call.key)
        if skeleton is not None:  # its outputs' structure changed
            self._structure_changed(call, messages.Skeleton.of(skeleton))
        what = (
            "returned gradients for arguments that its earlier calls with the same arguments "
            "had returned none for, and the backward had gone on without waiting for them"
            if gradients
            else "called another pipeline stage, which its earlier calls with the same "
            "arguments had not done, and the step function had not waited for it to finish"
        )
        raise CallStructureChanged(
            f"smp: module '{call.path}' (pipeline stage {call.owner}) {what} (asynchronous "
            "pipeline calls, design.md §4c). The module's calls are waited for from now on; "
            '"pipeline_async_calls": False makes every call wait.'
        )

    def _take_outputs(self, call: _Call, skeleton: messages.Skeleton, tensors) -> None:
        for slot, tensor in zip(messages.slots_of(skeleton), tensors):
            if slot.requires_grad and call.grad:
                tensor.requires_grad_(True)
                call.out_leaves.append((slot.index, tensor))
                call.worker.boundary[id(tensor)] = tensor
        call.values = list(tensors)

    def _replied(self, worker: _Worker, call: _Call) -> None:
        worker.replies_due -= 1
        if worker.waiting is call:
            worker.waiting = None
            self._grant(worker)
        elif worker.served is None:
            self._maybe_finish_microbatch(worker.microbatch)
        elif worker.finished and not worker.replies_due:
            self._reply(worker)

    # ---- the step ------------------------------------------------------------------------------

    def run_step(
        self, step_fn: Callable[..., Any], calls: list[tuple[tuple, dict]]
    ) -> tuple[list[Any], int]:
        """Runs one step on this rank. Returns (per-microbatch results, backward calls) on the
        leader; on other ranks the leader's results arrive through the caller (StepOutput)."""
        cfg = self.state.config
        leader = self.stage == 0
        self._back = _Baton()  # the baton, back from a worker (one per step)
        self._streams = _Streams()
        self.step_context = StepContext()  # what every worker of this step runs under
        self.recorder = _Recorder()
        self._call_ids = itertools.count()  # the same sequence on every TP rank of the stage
        self._stash = {}
        self.transport.start()
        self.sender = Sender(
            self.transport,
            [s for s in range(self.num_stages) if s != self.stage],
            self.timeout_s,
            self.state.device,
        )
        if self.order_transport is not None:
            self.order_transport.start()
        self.server = _C.PipelineServer(
            self.transport,
            cfg.pipeline,
            cfg.microbatches,
            cfg.active_microbatches,
            leader,
            self.deferred_weights,
            self.program,
        )
        self.policy = self.server.policy
        self.results: list[Any] = [None] * cfg.microbatches
        self.workers: dict[int, _Worker] = {}
        self.grad_tasks: dict[int, _Call] = {}  # task id -> call awaiting its GRAD_IN
        self.reply_tasks: dict[int, _Call] = {}  # task id -> call awaiting its REPLY
        self.continuations: dict[int, _Worker] = {}  # task id -> worker at a backward slice
        self.slices_run = 0  # backward slices run as their own task this step
        # task id -> (module path, weight half of its served call's backward)
        self.weight_tasks: dict[int, tuple[str | None, segments.WeightGrads]] = {}
        self.weights_run = 0  # weight halves run as their own task this step
        self.served_calls: dict[tuple[int, int], _Worker] = {}  # (caller stage, call id)
        self.early_fetches: dict[tuple[int, int], list] = {}  # (caller stage, call id) -> FETCHes
        # (owner, microbatch) -> id -> (weak reference to the tensor, its version, call id,
        # slot): what this stage's requests brought each owner (Note [Tensors sent once]). Weak:
        # remembering a tensor must not keep it alive past its last use.
        self.sent_inputs: dict[tuple[int, int], dict[int, tuple]] = {}
        self.step_workers: dict[int, _Worker] = {}  # microbatch -> leader worker
        self.quiet_calls: dict[int, _Call] = {}  # call id -> this rank's quiet call
        self.quiet_open = 0  # served quiet calls this rank must still finish (hold_open)
        self.backward_calls = 0
        self.done_mb: set[int] = set()
        self.step_fn, self.step_calls = step_fn, calls
        self.failed_microbatch: int | None = None
        self.failed_module: str | None = None
        self.ended = False
        error: BaseException | None = None
        hook = torch.nn.modules.module.register_module_forward_pre_hook(_resolve_module_args)
        try:
            self._loop(leader)
        except BaseException as exc:  # noqa: BLE001
            error = exc
            self._broadcast_error(exc)
            if self.order_transport is not None and self.order_leader:
                self._tell_followers([_ORDER_ABORT])  # they wait for this rank's next task
        finally:
            hook.remove()
            self._streams.close()
            abort_error = self._abort_workers()
            if abort_error is not None:
                if error is None:
                    error = abort_error
                else:
                    logger.warning("%s", abort_error)
            send_error = self.sender.close()
            if send_error is not None and (error is None or isinstance(error, _C.TransportError)):
                error = send_error  # the cause; a transport error here followed from its abort
            try:
                # Not aborted when it fails: a peer that is late (not gone) may still send on
                # this tag (its ERROR, its END), and a send to a rank that stopped receiving
                # waits until gloo's timeout, which closes every pair of the group for good.
                self.transport.finish(abort_on_failure=False)
                if self.order_transport is not None and error is None:
                    self.order_transport.finish(abort_on_failure=False)
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
            self._forget_step()
        if error is not None:
            # A failed step leaves the channels on this tag unusable (a receive may stay
            # posted). Every rank fails the step; after the outcome agreement, when every rank
            # is done sending on it, smp.step moves every rank to a fresh tag and aborts this
            # one (fresh_transports), whether its own part failed or not.
            raise error
        results, self.results = self.results, []  # the runtime keeps nothing of a step's data
        return results, self.backward_calls

    def fresh_transports(self) -> None:
        """After a step that failed on any rank, called on every rank (the outcome agreement
        says so): the next step talks on a tag no step has used. Deciding this from the agreed
        outcome rather than from this rank's own error keeps the ranks' tags equal: a rank whose
        part of the step finished (a peer failed after) moves on too. The old tag's
        receivers are aborted only here: every rank has left the step, so none sends on it."""
        self.transport.abort()
        if self.order_transport is not None:
            self.order_transport.abort()
        # Payloads carry no tag: a device payload a failed step left unmatched would be taken
        # by the next step's receive. New payload groups (every rank is here) start clean.
        self.state.renew_pipeline_payload_groups()
        self._tag = _fresh_tag(self.state)
        self.transport = self._new_transport()
        self.order_transport = self._new_order_transport()

    def _forget_step(self) -> None:
        """Drops the step's workers and calls. They reference each other (a call its worker, a
        served call's code its worker), so left alone their tensors (activations, boundary
        values, outputs) would wait for Python's cycle collector: tens of MB per step on the
        benchmark, freed at random times and making the next step fault in fresh pages."""
        for worker in [*self.workers.values(), *self.step_workers.values()]:
            worker.release()
        self.step_fn = self.step_calls = None  # the batch and the user's step function
        for table in (
            self.workers,
            self.step_workers,
            self.reply_tasks,
            self.grad_tasks,
            self.continuations,
            self.weight_tasks,
            self.served_calls,
            self.early_fetches,
            self.sent_inputs,
        ):
            table.clear()

    def _loop(self, leader: bool) -> None:
        """Runs what the C++ server hands out until the step is over on this rank."""
        while True:
            item = self._next_item()
            if item is None:
                if leader:
                    for peer in range(self.num_stages):
                        if peer != self.stage:
                            self.sender.send(peer, [STEP_END, self.backward_calls], [])
                    self._await_stage_ends()
                else:
                    self.backward_calls = self.server.announced_backward_calls
                    self.sender.send(0, [STEP_END], [])  # this stage's tail is done
                return
            task, message, target = item
            kind = task.kind
            if kind == _C.TaskKind.START_MICROBATCH:
                mb = task.microbatch
                args, kwargs = self.step_calls[mb]
                worker = _Worker(
                    self,
                    mb,
                    lambda a=args, k=kwargs: _resolve_results(self.step_fn(*a, **k)),
                    self.server.new_id(),
                )
                worker.rng_key = _mix(self._streams.base, mb)
                self.step_workers[mb] = worker
                self._start(worker)
            elif kind == _C.TaskKind.SERVE_REQUEST:
                self._serve(task.id, *message)
            elif kind == _C.TaskKind.RESUME:
                self._reply_arrived(self.reply_tasks.pop(task.id), message)
            elif kind == _C.TaskKind.WEIGHT:
                self._run_weights(task.microbatch, *self.weight_tasks.pop(task.id))
            elif message is None:  # the next backward slice of a worker
                worker = self.continuations.pop(task.id)
                self.slices_run += 1
                self._recorded_backward(worker, *self._pending_roots(worker, worker.next_interval))
            elif message[1][0] == GRAD_OUT:
                self._gradients_arrived(self.workers[target], *message)
            else:
                self._grad_in_arrived(self.grad_tasks.pop(task.id), *message)

    def _await_stage_ends(self) -> None:
        """On the leader, after its STEP_END: waits until every other stage has run the rest of
        its step (weight gradients it deferred, §4g) and said so with a STEP_END of its own. A
        stage that fails there sends ERROR instead, raised here as that stage's error; without
        this wait the leader would have finished and found the ERROR unread (a transport error
        naming no cause)."""
        waiting = {peer for peer in range(self.num_stages) if peer != self.stage}
        while waiting:
            got = self.transport.recv(self.timeout_s)
            if got is None:  # every peer finished: none can still report
                return
            peer, header, tensors = got
            if header[0] == ERROR:
                text = bytes(tensors[0].numpy()).decode() if tensors else "another stage failed"
                raise _C.RemoteStageError(text)
            if header[0] in (REPLY, GRAD_IN) and header[2] in self.quiet_calls:
                skeleton = tensors[0] if header[0] == REPLY and tensors else None
                self._quiet_answered(self.quiet_calls[header[2]], skeleton, header[0] == GRAD_IN)
            if header[0] != STEP_END:
                raise RuntimeError(
                    f"smp pipeline: stage {peer} sent message kind {header[0]} after the step "
                    "ended on the leader (an internal error)"
                )
            waiting.discard(peer)

    # ---- task order across the TP ranks of a stage ----------------------------------------------

    @staticmethod
    def _task_key(item) -> tuple[int, ...]:
        """What identifies a task on every TP rank of a stage: the message kind, the peer stage,
        the microbatch and the call id (ids of calls and workers are local, call ids are not:
        each rank's calls are numbered in the order it makes them, which is the same on all)."""
        task, message, _ = item
        if task.kind == _C.TaskKind.START_MICROBATCH:
            return (0, -1, task.microbatch, -1)
        peer, header, _ = message
        return (int(header[0]), int(peer), int(header[1]), int(header[2]))

    def _next_item(self):
        """The server's next task, in the order TP rank 0 of this stage runs them."""
        if self.order_transport is None:
            return self.server.next(self.timeout_s)
        if self.order_leader:
            item = self.server.next(self.timeout_s)
            self._tell_followers([_ORDER_END] if item is None else list(self._task_key(item)))
            return item
        got = self.order_transport.recv(self.timeout_s)
        if got is None:
            raise _C.TransportError(
                f"smp: stage {self.stage}, TP rank {self.state.axis_rank('tp')}: TP rank 0 of the "
                f"stage named no next task within timeout_s={self.timeout_s:g}"
            )
        wanted = tuple(got[1])
        if wanted == (_ORDER_ABORT,):
            raise _C.RemoteStageError(
                f"smp: TP rank 0 of pipeline stage {self.stage} failed this step; see its error"
            )
        if wanted == (_ORDER_END,):
            item = self.server.next(self.timeout_s)
            if item is not None or self._stash:
                raise RuntimeError(
                    "smp: the TP ranks of a pipeline stage ran different tasks this step (does "
                    "the model branch on data that differs between TP ranks?)"
                )
            return None
        while wanted not in self._stash:
            item = self.server.next(self.timeout_s)
            if item is None:
                raise RuntimeError(
                    f"smp: TP rank 0 of stage {self.stage} ran task {wanted}, which this TP rank "
                    "never received (does the model branch on data that differs between TP "
                    "ranks?)"
                )
            self._stash[self._task_key(item)] = item
        return self._stash.pop(wanted)

    def _tell_followers(self, header: list[int]) -> None:
        for peer in range(1, self.state.axis_size("tp")):
            if header != [_ORDER_ABORT]:
                self.order_transport.send(peer, header, [])
                continue
            # Best effort: this rank is failing already, and a follower may be gone.
            with contextlib.suppress(Exception):
                self.order_transport.send(peer, header, [])

    # ---- workers ---------------------------------------------------------------------------------

    def _start(self, worker: _Worker) -> None:
        self.workers[worker.id] = worker
        self.threads.run(worker)
        self._grant(worker)

    def _grant(self, worker: _Worker) -> None:
        self.state.microbatch = worker.microbatch
        self.state.in_step = True
        self.recorder.begin("F", worker.microbatch)
        self._streams.enter(worker)
        worker.go.release()
        # Twice timeout_s: the worker may itself wait up to timeout_s (a collective, a TP
        # rank's order), and the error of that wait names the failure better than this one.
        limit = _BATON_WAITS * self.timeout_s
        if not self._back.acquire(timeout=limit):
            worker.aborted = True  # it raises _Abort if it ever calls another stage
            self.failed_microbatch = worker.microbatch
            self.failed_module = worker.module_path
            raise TimeoutError(
                f"smp: pipeline stage {self.stage} waited {limit:g} s ({_BATON_WAITS} x "
                f"timeout_s) for {worker.describe()} to finish or to call another stage; it is "
                "still running (does its forward wait for something that never comes?)"
            )
        self._streams.leave(worker)
        self.recorder.end()
        self.state.microbatch = None
        if worker.error is not None:
            self.failed_microbatch = worker.microbatch
            self.failed_module = worker.module_path
            raise worker.error
        if worker.finished:
            self._on_finished(worker)

    def _on_finished(self, worker: _Worker) -> None:
        used: dict[tuple, bool] = {}  # its code is done: whether it used each output is known
        for call in worker.calls:
            if call.key is not None:
                used[call.key] = used.get(call.key, False) or call.used
        self.push_outputs.update(used)
        if worker.served is not None:
            if not worker.replies_due:  # else when the last REPLY to its own calls arrives
                self._reply(worker)
            return
        mb = worker.microbatch
        self.results[mb] = worker.result
        self._maybe_finish_microbatch(mb)

    def _reply(self, worker: _Worker) -> None:
        """REPLY of a served call: its forward and every call it made have finished."""
        offload.forward_done(worker.microbatch)  # offload_activations
        caller, call_id = worker.served
        sent = worker.sent_ids

        def resolve(tensor):  # a request tensor handed back travels as its slot number
            index = sent.get(id(tensor))
            return tensor if index is None else messages.Sent(index)

        unpacked, skeleton, tensors = messages.pack_parts(
            worker.result, resolve if sent else None, self.module_ids
        )
        worker.out_tensors, worker.skeleton = tensors, skeleton
        worker.replied = True
        reply = [REPLY, worker.microbatch, call_id, int(worker.calls_made == 0)]
        if not worker.quiet:
            self.sender.send(caller, reply, [skeleton, *tensors] if worker.push else [skeleton])
        else:
            self._hold(-1)  # its forward is done
            if not worker.quiet_refused and messages.digest(unpacked.blob) != worker.quiet_digest:
                worker.quiet_refused = True  # the caller learns, and reruns
                self.sender.send(caller, reply, [skeleton])
        for stage, fetch, slot in worker.fetches:
            self._send_outputs(stage, fetch, worker, slot)
        worker.fetches = []
        if not worker.grad:
            worker.backward_done = True
        deferred, worker.deferred = worker.deferred, []
        for consumer in deferred:
            self._start_when_ready(consumer)
        self._maybe_served_backward(worker)

    def _maybe_finish_microbatch(self, mb: int) -> None:
        worker = self.step_workers[mb]
        if mb in self.done_mb or not worker.finished or worker.replies_due or worker.acks_due:
            return
        if worker.next_interval >= 0 and not worker.backward_done:
            return
        self.done_mb.add(mb)
        self.policy.on_microbatch_finished(mb)

    def _abort_workers(self) -> BaseException | None:
        """Ends every suspended worker thread (they raise _Abort where they wait), within
        timeout_s in all; returns a TimeoutError naming those that did not end (else None)."""
        deadline = time.monotonic() + self.timeout_s
        stuck = []
        for worker in getattr(self, "workers", {}).values():
            if worker.aborted:  # ran past the baton's bound in _grant: nobody resumes it
                # (if it gave the baton back just after the bound, it waits in suspend: this
                # wakes it, and it ends there)
                worker.go.release()
                continue
            worker.aborted = True
            if worker.started and not worker.finished:
                worker.go.release()
                if not self._back.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    stuck.append(worker.describe())
        if not stuck:
            return None
        return TimeoutError(
            f"smp: pipeline stage {self.stage} aborted its step, but within timeout_s="
            f"{self.timeout_s:g} s these did not end: {'; '.join(stuck)}"
        )

    # ---- messages --------------------------------------------------------------------------------

    def _serve(self, worker_id: int, peer: int, header: list[int], tensors) -> None:
        """A REQUEST: runs the owned module's real forward on the caller's values, once every
        output of this rank's earlier calls that it takes by reference is computed and every
        input fetched from a third stage is here. A FETCH (``[REQUEST, mb, fetch id, -1, grad,
        1, 1, 0, caller, call id, slot]``) asks for the outputs of a call this rank served: from
        its caller (caller -1) all of them, from a third stage output ``slot``; they are sent
        once known."""
        if header[3] == _FETCH:
            caller, call_id = header[8], header[9]
            if caller < 0:
                caller = peer
            producer = self.served_calls.get((caller, call_id))
            if producer is None:  # the third stage's FETCH overtook the caller's REQUEST
                self.early_fetches.setdefault((caller, call_id), []).append(
                    (worker_id, peer, header)
                )
                return
            self._answer_fetch(producer, worker_id, peer, header)
            return
        self._start_when_ready(self._served_worker(worker_id, peer, header, tensors))

    def _answer_fetch(
        self, producer: _Worker, worker_id: int, peer: int, header: list[int]
    ) -> None:
        slot = header[10]
        if header[4]:  # the third stage's consumer will send this output's gradient (GRAD_OUT)
            if producer.backward_started:
                raise RuntimeError(
                    f"smp: an output of module '{producer.module_path}' was passed on after the "
                    "backward of its microbatch began"
                )
            producer.awaiting += 1
            self.workers[worker_id] = producer
        reply = [REPLY, header[1], header[2]]
        if producer.replied:
            self._send_outputs(peer, reply, producer, slot)
        else:
            producer.fetches.append((peer, reply, slot))

    def _send_outputs(self, peer: int, reply: list[int], producer: _Worker, slot: int) -> None:
        """Answers a FETCH: the skeleton and every output (``slot`` -1) or output ``slot``."""
        tensors = producer.out_tensors
        self.sender.send(
            peer, reply, [producer.skeleton, *(tensors if slot < 0 else tensors[slot : slot + 1])]
        )

    def _peer_input_arrived(self, fetch: _PeerFetch, message) -> None:
        """REPLY to a served call's FETCH from a third stage: one input value."""
        worker = fetch.worker
        skeleton, value = message[2][0], message[2][1]
        if worker.grad and messages.slots(skeleton)[fetch.out_slot].requires_grad:
            value.requires_grad_(True)
            worker.boundary[id(value)] = value
            fetch.leaf = value
        fetch.values[fetch.index] = value
        worker.fetches_due -= 1
        self._start_when_ready(worker)

    def _start_when_ready(self, worker: _Worker) -> None:
        if worker.fetches_due:
            return  # started when the last one arrives
        busy = [p for _, p, _ in worker.ref_inputs if not p.replied]
        if busy:
            busy[0].deferred.append(worker)  # checked again when that one finishes
        else:
            self._start(worker)

    def _served_worker(self, worker_id: int, peer: int, header: list[int], tensors) -> _Worker:
        mb, call_id, index, mode, flags, n_refs = header[1:7]
        refs = {header[7 + 4 * i]: tuple(header[8 + 4 * i : 11 + 4 * i]) for i in range(n_refs)}
        skeleton, payload = tensors[0], list(tensors[1:])
        worker = _Worker(self, mb, lambda: None, worker_id)
        worker.mode = CallMode.decode(mode)
        worker.rng_key = header[7 + 4 * n_refs]
        worker.grad = worker.mode.grad and self.step_context.mode.grad
        worker.awaiting = int(worker.grad)  # the caller's GRAD_OUT
        worker.served = (peer, call_id)
        worker.push = bool(flags & 1)
        if flags & _QUIET:
            worker.quiet = True
            worker.quiet_digest = header[8 + 4 * n_refs]
            self._hold(+1)  # until its forward is done
        worker.module_path = self.paths[index] or "<root>"
        self.served_calls[(peer, call_id)] = worker
        self.workers[worker_id] = worker  # a GRAD_OUT may come before it starts
        values: list[Any] = []
        slots = messages.slots(skeleton)
        for slot in slots:
            ref = refs.get(slot.index)
            if ref is not None and ref[0] >= 0:  # computed on a third stage
                stage, ref_call_id, out_slot = ref
                fetch_id = next(self._call_ids)
                fetch = _PeerFetch(worker, len(values), stage, fetch_id, out_slot, values)
                self._expect_reply(fetch, fetch_id, mb)
                header = _fetch_header(mb, fetch_id, worker.grad, peer, ref_call_id, out_slot)
                self.sender.send(stage, header, [])
                worker.peer_inputs.append(fetch)
                worker.fetches_due += 1
                values.append(None)
            elif ref is not None and ref[0] != messages.INPUT:
                producer = self.served_calls[(peer, ref[1])]
                if producer.backward_started:
                    raise RuntimeError(
                        f"smp: an output of module '{producer.module_path}' was passed to "
                        f"'{worker.module_path}' after the backward of its microbatch began"
                    )
                worker.ref_inputs.append((len(values), producer, ref[2]))
                if worker.grad:
                    producer.awaiting += 1
                values.append(None)  # filled when the worker starts (the producer may be busy)
            elif ref is not None:  # a tensor an earlier request brought (messages.INPUT)
                _, ref_call_id, in_slot = ref
                producer = self.served_calls.get((peer, ref_call_id))
                if producer is None or in_slot not in producer.received:
                    raise RuntimeError(
                        f"smp: a request for '{worker.module_path}' (microbatch {mb}) names "
                        f"slot {in_slot} of call {ref_call_id} from stage {peer}, which this "
                        "stage does not hold"
                    )
                # Its own leaf over the same data: the gradient goes back with this call's.
                values.append(producer.received[in_slot].detach())
            else:
                worker.received[slot.index] = payload[0]
                values.append(payload.pop(0))
        worker.input_leaves = []
        for slot, tensor in zip(slots, values):
            if tensor is not None and slot.requires_grad and worker.grad:
                tensor.requires_grad_(True)
                worker.boundary[id(tensor)] = tensor
                worker.input_leaves.append((slot.index, tensor))
        module = self.modules[self.paths[index]]

        def target():
            for i, producer, out_slot in worker.ref_inputs:
                # A copy: the consumer may modify its input in place; the producer's graph
                # may have saved it. Not an inference tensor: those keep no version counter,
                # which is how a change in place is seen (_call_and_note_changes).
                with torch.inference_mode(False):
                    value = producer.out_tensors[out_slot].detach().clone()
                if worker.grad and value.dtype.is_floating_point and producer.grad:
                    value.requires_grad_(producer.out_tensors[out_slot].requires_grad)
                if value.requires_grad:
                    worker.boundary[id(value)] = value
                    worker.ref_leaves.append((producer, out_slot, value))
                values[i] = value
            args, kwargs = messages.fill(messages.Skeleton.of(skeleton), values, self.modules)
            return _resolve_results(_call_and_note_changes(module, args, kwargs, values, worker))

        worker.target = target
        for waiting in self.early_fetches.pop((peer, call_id), []):
            self._answer_fetch(worker, *waiting)
        return worker

    def _gradients_arrived(self, worker: _Worker, peer: int, header: list[int], tensors) -> None:
        """GRAD_OUT reached a served call: its backward may start."""
        for slot, grad in zip(header[3:], tensors):
            _add(worker.out_grads_acc, slot, grad)
        worker.ones_slots += [-1 - slot for slot in header[3 + len(tensors) :]]
        if worker.quiet and worker.grad and (peer, header[2]) == worker.served:
            self._hold(+1)  # its caller's backward reached it: until its own is done
        worker.awaiting -= 1
        self._maybe_served_backward(worker)

    def _grad_in_arrived(self, call: _Call, peer: int, header: list[int], tensors) -> None:
        """GRAD_IN: the owner's backward of ``call`` (and of every call it made) is complete.
        When the caller sent tensors that require grad, it carries their gradients and the
        caller's backward continues; otherwise it only acknowledges."""
        if call.quiet:
            self._quiet_answered(call, None, gradients=True)
        if call.sent and call.key is not None:
            self.grads_back[call.key] = bool(tensors)
        worker = call.worker
        worker.acks_due -= 1
        if call.sent:
            grads: list[torch.Tensor | None] = [None] * len(call.sent)
            for slot, grad in zip(header[3:], tensors):
                grads[slot] = grad
            call.grad_in = grads
            self._run_backward(worker)
        elif worker.served is None:
            self._maybe_finish_microbatch(worker.microbatch)
        else:
            self._maybe_served_complete(worker)

    def _broadcast_error(self, exc: BaseException) -> None:
        if isinstance(exc, _C.RemoteStageError):
            return  # the stage that failed has told everyone
        where = f"stage {self.stage}"
        if self.failed_microbatch is not None:
            where += f", microbatch {self.failed_microbatch}"
        if self.failed_module is not None:
            where += f", module '{self.failed_module}'"
        text = f"{where}: {type(exc).__name__}: {exc}"
        blob = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
        for peer in range(self.num_stages):
            if peer != self.stage:
                # The peer may be gone already; this rank still fails with the original error.
                with contextlib.suppress(Exception):
                    self.transport.send(peer, [ERROR], [blob])

    # ---- backward --------------------------------------------------------------------------------

    def backward(self, tensors, grad_tensors) -> None:
        """``model.backward`` on the leader: the last interval of this microbatch's forward runs
        now; earlier ones run as their gradients arrive."""
        worker: _Worker | None = getattr(_current, "worker", None)
        if worker is None or worker.served is not None:
            raise RuntimeError("model.backward(loss) must be called in the @smp.step function")
        if worker.next_interval != -1:
            raise RuntimeError(
                "smp pipeline: model.backward may be called once per microbatch when "
                "pipeline_parallel_degree > 1; add the losses and call it once"
            )
        offload.forward_done(worker.microbatch)  # offload_activations
        roots = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        given = grad_tensors if grad_tensors is not None else [None] * len(roots)
        given = list(given) if isinstance(given, (list, tuple)) else [given]
        if len(given) < len(roots):  # zip below would drop the roots without one
            raise RuntimeError(
                f"got {len(roots)} tensors and {len(given)} gradients (model.backward: pass one "
                "gradient per tensor, or none for ones)"
            )
        # Note [Backward from futures]: outputs of this microbatch's calls that have not arrived
        # take their gradients along with the calls' GRAD_OUT, without waiting for them.
        local = []
        for root, grad in zip(roots, given):
            call = root._smp_call if isinstance(root, _Future) else None
            if (
                call is not None
                and call.worker is worker
                and call.values is None
                and call.grad
                and call.flags[root._smp_slot]
                and not isinstance(grad, _Future)
            ):
                call.root_grads.append((root._smp_slot, grad))
            else:
                local.append((root, grad))
        roots, grads = _resolve_tree(([r for r, _ in local], [g for _, g in local]))
        if len(local) == len(given) and not any(r.requires_grad for r in roots):
            raise RuntimeError(  # as torch.autograd.backward does (run_segment would skip them)
                "element 0 of tensors does not require grad and does not have a grad_fn "
                "(model.backward: nothing it was given needs a gradient; was the loss computed "
                "under torch.no_grad() or from detached values?)"
            )
        grads = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads)]
        self.policy.on_forward_done(worker.microbatch)
        self.backward_calls += 1
        worker.next_interval = len(worker.starts) - 1
        self._recorded_backward(worker, roots, grads)

    @contextlib.contextmanager
    def _backward_span(self, kind: str, microbatch: int, module: str | None):
        """A backward-type task as a recorded span ("B" or "W") of the timeline; if it fails,
        the error every stage raises names its microbatch and module."""
        self.recorder.begin(kind, microbatch)
        try:
            yield
        except BaseException:
            if self.failed_microbatch is None:
                self.failed_microbatch, self.failed_module = microbatch, module
            raise
        finally:
            self.recorder.end()

    def _recorded_backward(self, worker: _Worker, roots, grads) -> None:
        """``_continue_backward`` as a recorded "B" span of the timeline."""
        with self._backward_span("B", worker.microbatch, worker.module_path):
            self._continue_backward(worker, roots, grads)

    def _run_weights(self, microbatch: int, module: str | None, weights) -> None:
        """A WEIGHT task: the parameter gradients of a split segment, a "W" span."""
        self.weights_run += 1
        with self._backward_span("W", microbatch, module):
            weights.run()

    def _run_backward(self, worker: _Worker) -> None:
        """A BACKWARD task: GRAD_OUT reached a served call, or GRAD_IN returned to a caller."""
        with self._backward_span("B", worker.microbatch, worker.module_path):
            self._run_backward_task(worker)

    def _maybe_served_backward(self, worker: _Worker) -> None:
        """Starts a served call's backward once its forward is done and every gradient of its
        outputs is in: the caller's GRAD_OUT and the shares of this rank's calls that took its
        outputs by reference."""
        if worker.backward_started or not worker.replied or worker.awaiting or not worker.grad:
            return
        worker.backward_started = True
        for slot in worker.ones_slots:  # Note [Backward from futures]
            _add(worker.out_grads_acc, slot, torch.ones_like(worker.out_tensors[slot]))
        roots, grads = [], []
        for slot, grad in worker.out_grads_acc.items():
            if worker.out_tensors[slot].requires_grad:
                roots.append(worker.out_tensors[slot])
                grads.append(grad)
        worker.out_grads_acc = {}
        worker.next_interval = len(worker.starts) - 1
        self._recorded_backward(worker, roots, grads)

    def _run_backward_task(self, worker: _Worker) -> None:
        """GRAD_IN of the call ending interval ``next_interval`` arrived: that interval runs."""
        call = worker.calls[worker.next_interval]
        for edge, grad in zip(call.sent_edges, call.grad_in or []):
            if grad is None:
                continue
            variable = getattr(edge.node, "variable", None)
            if variable is not None:  # a leaf: a boundary value passed on, or a parameter
                if id(variable) in worker.boundary:
                    _add(worker.leaf_grads, id(variable), grad)
                else:
                    segments.accumulate([variable], [grad])
            else:
                pending = worker.pending[worker.interval_of(edge.node)]
                key = (id(edge.node), edge.output_nr)
                pending[key] = (edge, pending[key][1] + grad) if key in pending else (edge, grad)
        roots, grads = self._pending_roots(worker, worker.next_interval)
        self._continue_backward(worker, roots, grads)

    @staticmethod
    def _pending_roots(worker: _Worker, interval: int):
        pending = worker.pending[interval]
        worker.pending[interval] = {}
        return [e for e, _ in pending.values()], [g for _, g in pending.values()]

    def _continue_backward(self, worker: _Worker, roots, grads) -> None:
        if worker.uses is None:
            worker.uses = segments.Uses()
        while True:
            j = worker.next_interval
            if roots:
                result = segments.run_segment(
                    roots,
                    grads,
                    worker.starts[j],
                    boundary_leaves=worker.boundary.values(),
                    split_weights=self.split_weights
                    and worker.served is not None
                    and worker.microbatch >= self.split_from,
                    uses=worker.uses,
                )
                if result.weights is not None:
                    task_id = self.server.new_id()
                    self.weight_tasks[task_id] = (worker.module_path, result.weights)
                    self.policy.push(_C.TaskKind.WEIGHT, worker.microbatch, task_id)
                for key, (edge, grad) in result.edge_grads.items():
                    pending = worker.pending[worker.interval_of(edge.node)]
                    pending[key] = (
                        (edge, pending[key][1] + grad) if key in pending else (edge, grad)
                    )
                for leaf_id, grad in result.leaf_grads.items():
                    _add(worker.leaf_grads, leaf_id, grad)
            if j == 0:
                self._backward_finished(worker)
                return
            call = worker.calls[j - 1]
            worker.next_interval = j - 1
            if call.call_id == _SLICE:  # the server may run other work (a due resume) first
                task_id = self.server.new_id()
                self.continuations[task_id] = worker
                self.policy.push(_C.TaskKind.BACKWARD, worker.microbatch, task_id)
                return
            if call.grad:
                # Sent even without gradients: the owner's backward chain must complete, and it
                # answers GRAD_IN when it has. Only gradients this rank needs are waited for.
                out = [(s, worker.leaf_grads.pop(id(leaf), None)) for s, leaf in call.out_leaves]
                out = [(s, g) for s, g in out if g is not None]
                out += [(s, g) for s, g in call.root_grads if g is not None]
                ones = [-1 - s for s, g in call.root_grads if g is None]  # after those with one
                # A quiet call is not acknowledged; one that sent tensors needing gradients
                # still has its GRAD_IN routed, should gradients come after all (a rerun).
                if not call.quiet or call.sent:
                    task_id = self.server.new_id()
                    self.grad_tasks[task_id] = call
                    worker.acks_due += not call.quiet
                    self.server.expect(
                        call.call_id, _C.TaskKind.BACKWARD, worker.microbatch, task_id
                    )
                self.sender.send(
                    call.owner,
                    [GRAD_OUT, worker.microbatch, call.call_id, *(s for s, _ in out), *ones],
                    [g for _, g in out],
                )
                if call.sent and not call.quiet:
                    return  # continues when GRAD_IN arrives
            roots, grads = self._pending_roots(worker, j - 1)

    def _backward_finished(self, worker: _Worker) -> None:
        worker.backward_done = True
        worker.uses = None
        if worker.served is None:
            self._maybe_finish_microbatch(worker.microbatch)
            return
        # Its outputs hold its graph, which a weight half may have kept: only that half's
        # nodes stay alive (no FETCH reads the outputs once the backward has begun).
        worker.out_tensors, worker.result = [], None
        for producer, slot, leaf in worker.ref_leaves:  # shares of this rank's earlier calls
            grad = worker.leaf_grads.pop(id(leaf), None)
            if grad is not None:
                _add(producer.out_grads_acc, slot, grad)
        for _, producer, _ in worker.ref_inputs:
            producer.awaiting -= 1
            self._maybe_served_backward(producer)
        for fetch in worker.peer_inputs:  # the third stage waits for this share, even empty
            grad = worker.leaf_grads.pop(id(fetch.leaf), None) if fetch.leaf is not None else None
            slots, grads = ([fetch.out_slot], [grad]) if grad is not None else ([], [])
            self.sender.send(
                fetch.stage, [GRAD_OUT, worker.microbatch, fetch.fetch_id, *slots], grads
            )
        self._maybe_served_complete(worker)

    def _hold(self, change: int) -> None:
        """Counts the quiet calls this rank serves whose forward, or whose backward that has
        begun, is not done: the step does not end here before they are (Note [Quiet calls])."""
        self.quiet_open += change
        self.server.hold_open = self.quiet_open > 0

    def _refuse_quiet(self, worker: _Worker) -> None:
        """A quiet call is calling another stage: its caller, which does not wait for its end,
        is told (an empty REPLY) and runs the step again with the module's calls answered."""
        worker.quiet_refused = True
        self.sender.send(worker.served[0], [REPLY, worker.microbatch, worker.served[1]], [])

    def _maybe_served_complete(self, worker: _Worker) -> None:
        """GRAD_IN to the caller once this call's backward is done and every call it made has
        acknowledged its own (so the caller learns when the whole subtree is complete)."""
        if not worker.backward_done or worker.acks_due or worker.completed:
            return
        worker.completed = True
        caller, call_id = worker.served
        grads = [worker.leaf_grads.pop(id(leaf), None) for _, leaf in worker.input_leaves]
        present = [i for i, g in enumerate(grads) if g is not None]
        if worker.quiet:
            self._hold(-1)
            if not present or worker.quiet_refused:
                return
            worker.quiet_refused = True  # gradients after all: the caller learns, and reruns
        self.sender.send(
            caller, [GRAD_IN, worker.microbatch, call_id, *present], [grads[i] for i in present]
        )


def _program(schedule: str, num_stages: int, microbatches: int, stage: int) -> list[str]:
    """Stage ``stage``'s compute actions in the schedule IR's ``schedule`` (config
    ``pipeline_schedule``), as action strings ("1F0", "1I0", "1W0")."""
    generate = {
        "zbh1": _C.schedule.zero_bubble_h1,
        "1f1b": _C.schedule.one_f_one_b,
        "gpipe": _C.schedule.gpipe,
    }[schedule]
    return [str(action) for action in generate(num_stages, microbatches)[stage] if action]


def _add(store: dict, key: int, grad: torch.Tensor) -> None:
    store[key] = store[key] + grad if key in store else grad

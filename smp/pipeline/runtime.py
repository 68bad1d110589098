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
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from smp import _C
from smp.pipeline import messages, segments
from smp.state import State

__all__ = ["PipelineRuntime"]

REQUEST, REPLY, GRAD_OUT, GRAD_IN, ERROR, STEP_END = range(1, 7)
_ORDER_END, _ORDER_ABORT = -1, -2  # TP task order: the step is over / TP rank 0 failed
_TAG = 0x5E7


class _Abort(BaseException):
    """Raised inside a suspended worker when the step is aborted (not an Exception on purpose)."""


@dataclasses.dataclass
class _Call:
    """A remote call made by a worker: what backward needs to know about it."""

    call_id: int
    owner: int
    sent: list[torch.Tensor]  # sent tensors that require grad, in slot order
    sent_edges: list[Any]  # their gradient edges
    out_leaves: list[torch.Tensor] = dataclasses.field(default_factory=list)
    participates: bool = False  # some output requires grad: backward crosses this call
    grad_in: list[torch.Tensor | None] | None = None


class _Worker:
    """A forward running in its own thread: the step function (leader) or a served call."""

    def __init__(
        self, runtime: PipelineRuntime, microbatch: int, target: Callable[[], Any], worker_id: int
    ):
        self.id = worker_id
        self.runtime = runtime
        self.microbatch = microbatch
        self.target = target
        self.go = threading.Semaphore(0)
        self.finished = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.error_text = ""
        self.aborted = False
        self.reply: Any = None  # (skeleton, tensors) of the REPLY that resumes this worker
        self.out_grads: tuple[list[int], list[torch.Tensor]] | None = None  # served: GRAD_OUT
        # backward bookkeeping
        self.starts: list[int] = []
        self.calls: list[_Call] = []
        self.boundary: dict[int, torch.Tensor] = {}  # id -> fresh leaf (served inputs, replies)
        self.pending: list[dict] = []  # per interval: edge key -> (edge, grad)
        self.leaf_grads: dict[int, torch.Tensor] = {}
        self.next_interval = -1  # next interval whose backward runs (-1: backward not started)
        self.backward_done = False
        self.served: tuple[int, int] | None = None  # (caller stage, call id) for served calls
        self.module_path: str | None = None  # the module a served call runs
        self.input_leaves: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []  # served: output tensors in slot order
        self.thread = threading.Thread(target=self._main, daemon=True, name=f"smp-worker{self.id}")

    def _main(self) -> None:
        self.go.acquire()
        _current.worker = self
        torch.set_grad_enabled(self.runtime.grad_enabled)
        try:
            if self.aborted:
                raise _Abort()
            self.starts.append(segments.mark())
            self.pending.append({})
            self.result = self.target()
        except _Abort:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported through the server
            self.error = exc
            self.error_text = "".join(traceback.format_exception(exc))
        finally:
            self.finished = True
            self.runtime._back.release()

    def suspend(self) -> None:
        """Gives the baton back to the server and waits to be resumed."""
        self.runtime._back.release()
        self.go.acquire()
        if self.aborted:
            raise _Abort()

    def new_interval(self) -> None:
        self.starts.append(segments.mark())
        self.pending.append({})

    def interval_of(self, node) -> int:
        seq = node._sequence_nr()
        index = 0
        for i, start in enumerate(self.starts):
            if start <= seq:
                index = i
        return index


_current = threading.local()
_remote_classes: dict[type, type] = {}


def _remote_call_dunder(self, *args, **kwargs):
    runtime, path, owner = self._smp_remote
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


class PipelineRuntime:
    """Runs steps of a partitioned model; one per DistributedModel with pp > 1."""

    def __init__(self, state: State, module: nn.Module, assignment: dict[str, int]):
        self.state = state
        self.stage = state.axis_rank("pp")
        self.num_stages = state.axis_size("pp")
        self.module = module
        self.paths = [path for path, _ in module.named_modules()]
        self.modules = dict(module.named_modules())
        self.index_of = {path: i for i, path in enumerate(self.paths)}
        self.assignment = assignment
        self._tag = _TAG
        self.transport = self._new_transport()
        # With tensor parallelism, the TP ranks of a stage must run their tasks in one order (the
        # modules' TP collectives are matched by order): TP rank 0 picks, the others follow.
        self.order_group = state.groups.get("tp_order")
        self.order_leader = state.axis_rank("tp") == 0
        self.order_transport = self._new_order_transport()
        self._stash: dict[tuple, Any] = {}
        self.timeout_s = float(state.config.timeout_s)
        self._back = threading.Semaphore(0)
        self._call_ids = itertools.count()
        self.grad_enabled = True
        self._install_stubs()
        state.closers.append(self.close)
        state.runtimes.append(self)

    def close(self) -> None:
        """Releases the transport and everything that keeps it (and so its process group) alive;
        called by smp.shutdown() before the groups are destroyed. A transport left to the
        interpreter's final garbage collection would destroy its group in an arbitrary order
        ('terminate called without an active exception' at exit)."""
        self.policy = None  # a view into the server
        self.server = None  # keeps the transport alive (pybind keep_alive)
        self.workers = {}
        transport, self.transport = self.transport, None
        order, self.order_transport = self.order_transport, None
        for t in (transport, order):
            if t is not None:
                t.abort()
        del transport, order, t

    def _new_order_transport(self):
        if self.order_group is None:
            return None
        n = self.state.axis_size("tp")
        peers = list(range(1, n)) if self.order_leader else [0]
        return _C.Transport(self.order_group, peers, float(self.state.config.timeout_s), self._tag)

    def _new_transport(self):
        peers = [s for s in range(self.num_stages) if s != self.stage]
        return _C.Transport(
            self.state.groups["pp"], peers, float(self.state.config.timeout_s), self._tag
        )

    # ---- stubs ---------------------------------------------------------------------------------

    def _install_stubs(self) -> None:
        """Modules owned by other stages get a class whose ``__call__`` is a remote call.

        Replacing ``__call__`` (not ``forward``) keeps the module's hooks off the caller: they
        run once, on the owner, around the real forward.
        """
        for path, module in self.modules.items():
            owner = self.assignment[path]
            if owner != self.stage:
                object.__setattr__(module, "_smp_remote", (self, path, owner))
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
        skeleton, tensors = messages.pack((args, kwargs))
        call_id = next(self._call_ids)
        sent = [t for t in tensors if t.requires_grad]
        call = _Call(call_id, owner, sent, [segments.edge_of(t) for t in sent])
        worker.calls.append(call)
        self.server.expect(call_id, _C.TaskKind.RESUME, worker.microbatch, worker.id)
        self.transport.send(
            owner, [REQUEST, worker.microbatch, call_id, index], [skeleton, *tensors]
        )
        worker.suspend()
        skeleton, tensors = worker.reply
        worker.reply = None
        leaves = []
        for slot, tensor in zip(messages.slots(skeleton), tensors):
            if slot.requires_grad and torch.is_grad_enabled():
                tensor.requires_grad_(True)
                leaves.append(tensor)
                worker.boundary[id(tensor)] = tensor
        call.out_leaves = leaves
        call.participates = bool(leaves)
        worker.new_interval()
        return messages.unpack(skeleton, tensors)

    # ---- the step ------------------------------------------------------------------------------

    def run_step(
        self, step_fn: Callable[..., Any], calls: list[tuple[tuple, dict]]
    ) -> tuple[list[Any], int]:
        """Runs one step on this rank. Returns (per-microbatch results, backward calls) on the
        leader; on other ranks the leader's results arrive through the caller (StepOutput)."""
        cfg = self.state.config
        leader = self.stage == 0
        self.grad_enabled = torch.is_grad_enabled()
        self.recorder = _Recorder()
        self._call_ids = itertools.count()  # the same sequence on every TP rank of the stage
        self._stash = {}
        self.transport.start()
        if self.order_transport is not None:
            self.order_transport.start()
        self.server = _C.PipelineServer(
            self.transport, cfg.pipeline, cfg.microbatches, cfg.active_microbatches, leader
        )
        self.policy = self.server.policy
        self.results: list[Any] = [None] * cfg.microbatches
        self.workers: dict[int, _Worker] = {}
        self.call_of: dict[int, tuple[_Worker, _Call]] = {}
        self.step_workers: dict[int, _Worker] = {}  # microbatch -> leader worker
        self.backward_calls = 0
        self.done_mb: set[int] = set()
        self.step_fn, self.step_calls = step_fn, calls
        self.failed_microbatch: int | None = None
        self.failed_module: str | None = None
        self.ended = False
        error: BaseException | None = None
        try:
            self._loop(leader)
        except BaseException as exc:  # noqa: BLE001
            error = exc
            self._broadcast_error(exc)
            if self.order_transport is not None and self.order_leader:
                self._tell_followers([_ORDER_ABORT])  # they wait for this rank's next task
        finally:
            self._abort_workers()
            try:
                self.transport.finish()
                if self.order_transport is not None and error is None:
                    self.order_transport.finish()
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            # A failed step leaves the channels on this tag unusable (a receive may stay posted):
            # every rank fails the step, and every rank moves to a fresh tag for the next one.
            self.transport.abort()
            if self.order_transport is not None:
                self.order_transport.abort()
            self._tag += 1
            self.transport = self._new_transport()
            self.order_transport = self._new_order_transport()
            raise error
        return self.results, self.backward_calls

    def _loop(self, leader: bool) -> None:
        """Runs what the C++ server hands out until the step is over on this rank."""
        while True:
            item = self._next_item()
            if item is None:
                if leader:
                    for peer in range(self.num_stages):
                        if peer != self.stage:
                            self.transport.send(peer, [STEP_END, self.backward_calls], [])
                else:
                    self.backward_calls = self.server.announced_backward_calls
                return
            task, message = item
            kind = task.kind
            if kind == _C.TaskKind.START_MICROBATCH:
                mb = task.microbatch
                args, kwargs = self.step_calls[mb]
                worker = _Worker(
                    self, mb, lambda a=args, k=kwargs: self.step_fn(*a, **k), self.server.new_id()
                )
                self.step_workers[mb] = worker
                self._start(worker)
            elif kind == _C.TaskKind.SERVE_REQUEST:
                self._start(self._served_worker(task.id, *message))
            elif kind == _C.TaskKind.RESUME:
                worker = self.workers[task.id]
                tensors = message[2]
                worker.reply = (tensors[0], tensors[1:])
                self._grant(worker)
            else:
                self._gradients_arrived(self.workers[task.id], *message)

    # ---- task order across the TP ranks of a stage ----------------------------------------------

    @staticmethod
    def _task_key(item) -> tuple[int, ...]:
        """What identifies a task on every TP rank of a stage: the message kind, the peer stage,
        the microbatch and the call id (ids of calls and workers are local, call ids are not:
        each rank's calls are numbered in the order it makes them, which is the same on all)."""
        task, message = item
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
            raise TimeoutError(
                f"smp: stage {self.stage}, TP rank {self.state.axis_rank('tp')}: TP rank 0 of the "
                f"stage named no next task within timeout_s={self.timeout_s:g}"
            )
        wanted = tuple(got[1])
        if wanted == (_ORDER_ABORT,):
            raise RuntimeError(
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
        worker.thread.start()
        self._grant(worker)

    def _grant(self, worker: _Worker) -> None:
        self.state.microbatch = worker.microbatch
        self.state.in_step = True
        self.recorder.begin("F", worker.microbatch)
        worker.go.release()
        self._back.acquire()
        self.recorder.end()
        self.state.microbatch = None
        if worker.error is not None:
            self.failed_microbatch = worker.microbatch
            self.failed_module = worker.module_path
            raise worker.error
        if worker.finished:
            self._on_finished(worker)

    def _on_finished(self, worker: _Worker) -> None:
        if worker.served is not None:
            caller, call_id = worker.served
            skeleton, tensors = messages.pack(worker.result)
            worker.outputs = [t for t in tensors if t.requires_grad]
            self.transport.send(caller, [REPLY, worker.microbatch, call_id], [skeleton, *tensors])
            if not worker.outputs:
                worker.backward_done = True
            return
        mb = worker.microbatch
        self.results[mb] = worker.result
        self._maybe_finish_microbatch(mb)

    def _maybe_finish_microbatch(self, mb: int) -> None:
        worker = self.step_workers[mb]
        if mb in self.done_mb or not worker.finished:
            return
        if worker.next_interval >= 0 and not worker.backward_done:
            return
        self.done_mb.add(mb)
        self.policy.on_microbatch_finished(mb)

    def _abort_workers(self) -> None:
        """Ends every suspended worker thread (they raise _Abort where they wait)."""
        for worker in getattr(self, "workers", {}).values():
            worker.aborted = True
            if worker.thread.is_alive() and not worker.finished:
                worker.go.release()
                self._back.acquire()

    # ---- messages --------------------------------------------------------------------------------

    def _served_worker(self, worker_id: int, peer: int, header: list[int], tensors) -> _Worker:
        """A worker for a REQUEST: the owned module's real forward on the caller's values."""
        mb, call_id, index = header[1], header[2], header[3]
        skeleton, payload = tensors[0], tensors[1:]
        worker = _Worker(self, mb, lambda: None, worker_id)
        leaves = []
        for slot, tensor in zip(messages.slots(skeleton), payload):
            if slot.requires_grad and self.grad_enabled:
                tensor.requires_grad_(True)
                worker.boundary[id(tensor)] = tensor
                leaves.append(tensor)
        worker.input_leaves = leaves
        args, kwargs = messages.unpack(skeleton, payload)
        module = self.modules[self.paths[index]]
        worker.target = lambda: module(*args, **kwargs)
        worker.module_path = self.paths[index] or "<root>"
        worker.served = (peer, call_id)
        return worker

    def _gradients_arrived(self, worker: _Worker, peer: int, header: list[int], tensors) -> None:
        """GRAD_OUT reached a served call, or GRAD_IN returned to a caller: continue backward."""
        present = header[3:]
        if header[0] == GRAD_OUT:
            worker.out_grads = (present, tensors)
        else:
            _, call = self.call_of.pop(header[2])
            grads: list[torch.Tensor | None] = [None] * len(call.sent)
            for slot, grad in zip(present, tensors):
                grads[slot] = grad
            call.grad_in = grads
        self._run_backward(worker)

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
        roots = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        if grad_tensors is None:
            grads = [torch.ones_like(r) for r in roots]
        else:
            grads = (
                list(grad_tensors) if isinstance(grad_tensors, (list, tuple)) else [grad_tensors]
            )
        self.policy.on_forward_done(worker.microbatch)
        self.backward_calls += 1
        worker.next_interval = len(worker.starts) - 1
        self.recorder.begin("B", worker.microbatch)
        try:
            self._continue_backward(worker, roots, grads)
        finally:
            self.recorder.end()

    def _run_backward(self, worker: _Worker) -> None:
        """A BACKWARD task: GRAD_OUT reached a served call, or GRAD_IN returned to a caller."""
        self.recorder.begin("B", worker.microbatch)
        try:
            self._run_backward_task(worker)
        finally:
            self.recorder.end()

    def _run_backward_task(self, worker: _Worker) -> None:
        if worker.served is not None and worker.next_interval == -1:
            present, grads = worker.out_grads
            worker.out_grads = None
            roots = [worker.outputs[i] for i in present]
            worker.next_interval = len(worker.starts) - 1
            self._continue_backward(worker, roots, list(grads))
            return
        call = worker.calls[worker.next_interval]
        for edge, grad in zip(call.sent_edges, call.grad_in or []):
            if grad is None:
                continue
            variable = getattr(edge.node, "variable", None)
            if variable is not None:  # a leaf: a boundary value passed on, or a parameter
                if id(variable) in worker.boundary:
                    _add(worker.leaf_grads, id(variable), grad)
                elif variable.grad is None:
                    variable.grad = grad.clone()
                else:
                    variable.grad.add_(grad)
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
        while True:
            j = worker.next_interval
            if roots:
                result = segments.run_segment(
                    roots, grads, worker.starts[j], boundary_leaves=worker.boundary.values()
                )
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
            if call.participates:
                out = [worker.leaf_grads.pop(id(leaf), None) for leaf in call.out_leaves]
                present = [i for i, g in enumerate(out) if g is not None]
                self.call_of[call.call_id] = (worker, call)
                self.server.expect(call.call_id, _C.TaskKind.BACKWARD, worker.microbatch, worker.id)
                self.transport.send(
                    call.owner,
                    [GRAD_OUT, worker.microbatch, call.call_id, *present],
                    [out[i] for i in present],
                )
                return  # continues when GRAD_IN arrives
            roots, grads = self._pending_roots(worker, j - 1)

    def _backward_finished(self, worker: _Worker) -> None:
        worker.backward_done = True
        if worker.served is None:
            self._maybe_finish_microbatch(worker.microbatch)
            return
        caller, call_id = worker.served
        grads = [worker.leaf_grads.pop(id(leaf), None) for leaf in worker.input_leaves]
        present = [i for i, g in enumerate(grads) if g is not None]
        self.transport.send(
            caller, [GRAD_IN, worker.microbatch, call_id, *present], [grads[i] for i in present]
        )


def _add(store: dict, key: int, grad: torch.Tensor) -> None:
    store[key] = store[key] + grad if key in store else grad

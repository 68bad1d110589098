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

Where each part lives (``PipelineRuntime`` composes the mixins; they share its state):

- this module: the runtime object (its transports, tables and lifetime), the step (``run_step``,
  the server loop, the end of a step and its failure), the task order across a stage's TP ranks,
  and granting the baton to workers.
- ``smp.pipeline.protocol``: the messages' kinds and header layouts; Note [Quiet calls].
- ``smp.pipeline.workers``: workers and what they record (``_Call``, ``_PeerFetch``), the baton,
  the worker threads, random streams, the timeline recorder.
- ``smp.pipeline.calls``: the caller's side of a remote call (``CallsMixin``): stubs, REQUEST,
  REPLY, futures, argument write-back; ``CallStructureChanged``; Notes [Ops on futures run where
  the value is] and [Tensors sent once].
- ``smp.pipeline.serving``: the owner's side (``ServingMixin``): served calls, FETCH, REPLY.
- ``smp.pipeline.backward``: the backward (``BackwardMixin``): GRAD_OUT / GRAD_IN, intervals and
  backward slices, weight halves; Note [Backward from futures].
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from smp import _C
from smp.core import tree
from smp.pipeline import segments
from smp.pipeline.backward import BackwardMixin
from smp.pipeline.cache import LRU
from smp.pipeline.calls import (
    CallsMixin,
    CallStructureChanged,
    _RemoteOps,
    _resolve_module_args,
    _resolve_results,
)
from smp.pipeline.context import StepContext
from smp.pipeline.protocol import ERROR, GRAD_IN, GRAD_OUT, REPLY, STEP_END
from smp.pipeline.sender import Sender
from smp.pipeline.serving import ServingMixin
from smp.pipeline.workers import _Baton, _Call, _mix, _Recorder, _Streams, _Threads, _Worker
from smp.state import State

__all__ = ["CallStructureChanged", "PipelineRuntime"]

logger = logging.getLogger("smp")

_BATON_WAITS = 2  # the server waits this many timeout_s at most for a worker to yield
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


class PipelineRuntime(CallsMixin, ServingMixin, BackwardMixin):
    """Runs steps of a partitioned model; one per DistributedModel with pp > 1.

    Its remote calls, the calls it serves and its backward are methods of its mixins
    (smp.pipeline.calls, smp.pipeline.serving, smp.pipeline.backward), on the state set up
    here and in :meth:`run_step`."""

    # A tensor goes to an owner once per microbatch (Note [Tensors sent once]).
    send_once = True
    # One the owner does not read stays here until it does (Note [Arguments fetched when read]).
    keep_unread = True

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
        # (owner, module index, argument structure) -> request slots its owner read (FETCHed)
        # of those kept here (Note [Arguments fetched when read]); keys learned per module.
        self.argument_reads = LRU()
        self.kept_structures: dict[tuple[int, int], int] = {}
        self.threads = self._held.threads
        # Zero-bubble split (design.md §4.4): stages other than the leader's compute a served
        # call's input gradients first and its weight gradients when idle. Not with TP (its
        # ranks must run the same tasks, and weight tasks fill idle time).
        splits = self.stage != 0 and self.order_group is None
        deferred = int(getattr(state.config, "deferred_weight_microbatches", 0) or 0)
        # "static" (design.md §4.5): this stage's program orders its work; it places weight
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
        # backward costs more than a whole one (design.md §4.4).
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
            "argument_reads": self.argument_reads,
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
        payload groups where there are some (NCCL; design.md §4.8), else staged through the
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

    # ---- the step ------------------------------------------------------------------------------

    def run_step(
        self, step_fn: Callable[..., Any], calls: list[tuple[tuple, dict]], detach: bool = True
    ) -> tuple[list[Any], int]:
        """Runs one step on this rank. Returns (per-microbatch results, backward calls) on the
        leader; on other ranks the leader's results arrive through the caller (StepOutput).
        ``detach``: the results are detached from the graph as each microbatch finishes
        (``smp.step``'s ``detach_outputs``)."""
        cfg = self.state.config
        self.detach_results = detach
        leader = self.stage == 0
        self._back = _Baton()  # the baton, back from a worker (one per step)
        self._streams = _Streams()
        self.step_context = StepContext()  # what every worker of this step runs under
        self.recorder = _Recorder()
        self._call_ids = itertools.count()  # the same sequence on every TP rank of the stage
        self._stash = {}
        self._handoff: tuple[str, Any] | None = None  # Note [Direct resumes]
        self.transport.start()
        self.sender = Sender(
            self.transport,
            [s for s in range(self.num_stages) if s != self.stage],
            self.timeout_s,
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
        # Note [Arguments fetched when read]: call id -> (its key, {slot: copy}) of the tensors
        # this stage's calls kept; (caller stage, call id, slot) -> the value fetched here.
        self.kept_arguments: dict[int, tuple[tuple, dict[int, torch.Tensor]]] = {}
        self.fetched_values: dict[tuple[int, int, int], torch.Tensor] = {}
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

    # Note [Tensors of a finished call]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A served call whose subtree is complete (its backward done, every call it made acknowledged,
    # its GRAD_IN sent or, quiet, not needed) and a microbatch's step function once the
    # microbatch is finished on this rank are read by nothing else this step: no FETCH reads a
    # call's outputs once its backward has begun, its consumers' gradient shares have arrived,
    # and a step that reruns (CallStructureChanged) starts from new workers. So they drop their
    # tensors then (inputs and replies as leaves, outputs, gradients, their calls' values and
    # sent tensors; the step function's result is already in ``results``), not at the step's end:
    # otherwise a stage held every microbatch's messages until the step ended, a memory growing
    # with the microbatch count that 1F1B's bound on microbatches in flight does not see. The
    # result is detached then too (unless ``detach_outputs=False``): its graph, though its saved
    # tensors are freed, keeps every leaf it reached, the replies from other stages among them
    # (about one message per microbatch on the first stage of a GPT at pp 2). What a
    # weight half kept apart (zero-bubble) holds its own references; a quiet call answered late
    # (smp.pipeline.protocol) reads only its key, path, owner and prediction.

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
            self.kept_arguments,
            self.fetched_values,
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
        its step (weight gradients it deferred, §4.4) and said so with a STEP_END of its own. A
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
        """The server's next task, in the order TP rank 0 of this stage runs them: the one a
        worker took and handed back (Note [Direct resumes]) first."""
        if self._handoff is not None:
            what, value = self._handoff
            self._handoff = None
            if what == "error":
                raise value
            return value
        return self._take_item()

    def _take_item(self):
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
        resumes = worker.resumes
        while not self._back.acquire(timeout=limit):
            if worker.resumes != resumes:  # it waited for a reply and went on (direct resumes)
                resumes = worker.resumes
                continue
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

    # Note [Direct resumes]
    # ~~~~~~~~~~~~~~~~~~~~~
    # A worker that waits for a REPLY holds the baton, so it may take the server's next task
    # itself instead of handing the baton to the loop, which would take that task and, most
    # often, hand the baton straight back (the default policy runs a ready resume first). When
    # the task is its own RESUME the worker processes the REPLY as the loop would and goes on:
    # two thread hand-offs (the return and the grant) and a random-stream switch fewer per
    # awaited call. Any other task, or an error taking one, is handed to the loop, which runs it
    # next (``_handoff``), so the order of tasks and where errors are raised do not change. The
    # loop's bound on the worker restarts at each such resume (``_Worker.resumes``): each of its
    # waits is bounded by timeout_s in the server. The recorder's span pauses while it waits.

    def resume_directly(self, worker: _Worker) -> bool:
        """In ``worker``'s thread, holding the baton, waiting for ``worker.waiting``'s REPLY:
        takes the server's tasks while they are that REPLY's (Note [Direct resumes]). True once
        the worker may go on; False when it must suspend (a task for the loop is handed over)."""
        self.recorder.pause()
        self.state.microbatch = None
        while True:
            try:
                item = self._next_item()
                if worker.aborted:  # its step gave up on it meanwhile: suspend() raises _Abort
                    return False
                task = None if item is None else item[0]
                if (
                    task is None
                    or task.kind != _C.TaskKind.RESUME
                    or self.reply_tasks.get(task.id) is not worker.waiting
                ):
                    self._handoff = ("item", item)
                    return False
                worker.resuming = True
                try:
                    self._reply_arrived(self.reply_tasks.pop(task.id), item[1])
                finally:
                    worker.resuming = False
            except BaseException as exc:  # noqa: BLE001 - raised by the loop, as before
                self._handoff = ("error", exc)
                return False
            if worker.waiting is None:
                worker.resumes += 1
                self.state.microbatch = worker.microbatch
                self.recorder.resume()
                return True

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

    def _maybe_finish_microbatch(self, mb: int) -> None:
        worker = self.step_workers[mb]
        if mb in self.done_mb or not worker.finished or worker.replies_due or worker.acks_due:
            return
        if worker.next_interval >= 0 and not worker.backward_done:
            return
        self.done_mb.add(mb)
        if self.detach_results:  # Note [Tensors of a finished call]
            self.results[mb] = tree.map_tensors(torch.Tensor.detach, self.results[mb])
        self._release_finished(worker)
        self.policy.on_microbatch_finished(mb)

    def _release_finished(self, worker: _Worker) -> None:
        """Note [Tensors of a finished call]."""
        for call in worker.calls:  # a quiet one stays in quiet_calls, its answer reads no tensor
            call.values = call.grad_in = None
            call.sent, call.sent_edges, call.out_leaves, call.root_grads = [], [], [], []
        worker.release()

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

    # ---- a failed step ------------------------------------------------------------------------

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


def _program(schedule: str, num_stages: int, microbatches: int, stage: int) -> list[str]:
    """Stage ``stage``'s compute actions in the schedule IR's ``schedule`` (config
    ``pipeline_schedule``), as action strings ("1F0", "1I0", "1W0")."""
    generate = {
        "zbh1": _C.schedule.zero_bubble_h1,
        "1f1b": _C.schedule.one_f_one_b,
        "gpipe": _C.schedule.gpipe,
    }[schedule]
    return [str(action) for action in generate(num_stages, microbatches)[stage] if action]

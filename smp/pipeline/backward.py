"""The pipeline's backward (design.md §4.4, §4.4): gradient messages, intervals, weight halves.

A worker's forward is cut into intervals at its remote calls, and before large local modules
(backward slices, §4.4). Intervals run backward in reverse order, each as a segment
(smp.pipeline.segments), as their gradients become complete, in the server thread. Gradients
cross stages as GRAD_OUT (caller → owner, gradients of a call's outputs) and GRAD_IN (owner →
caller, gradients of its inputs; without any, it says that the call's backward is done). Stages
other than the leader's may compute a served call's input gradients first and its weight
gradients later, as a WEIGHT task (zero-bubble split, §4.4).

:class:`BackwardMixin` is this part of ``PipelineRuntime`` (smp.pipeline.runtime), which
composes it and sets up the state its methods use.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from smp import _C
from smp.memory import offload
from smp.pipeline import segments
from smp.pipeline.calls import _Future, _resolve_tree
from smp.pipeline.protocol import GRAD_IN, GRAD_OUT
from smp.pipeline.workers import _SLICE, _Call, _current, _Worker

_SLICES_PER_STAGE = 8  # a module with this fraction of its stage's cost starts a backward slice


# Note [Backward from futures]
# The leader's ``model.backward(loss)`` takes its roots as they are: a root that is an output of
# one of this microbatch's calls whose value has not arrived (the loss of an HF causal LM,
# computed on the head's stage by ops on futures) is not waited for. Its gradient (the one
# given, or ones, which the owner builds from the output) goes with that call's GRAD_OUT, which
# the backward sends at once: the last stage starts a microbatch's backward when its forward is
# done, as in torch's schedules, not after a round trip to the leader, which is by then busy
# with another microbatch's forward. A root that the prediction says needs no gradient is
# resolved, and raises as torch would.


class BackwardMixin:
    """The backward of a pipelined step, for ``PipelineRuntime``: model.backward on the
    leader, GRAD_OUT and GRAD_IN, backward slices and weight halves as tasks."""

    def _slice_modules(self, costs: dict[str, float]) -> set[int]:
        """Ids of the local modules whose forward starts a new backward slice: every module
        whose subtree runs on this stage only and costs at least 1/_SLICES_PER_STAGE of the
        stage (``costs``: each module's own share of the model's cost, from the partitioner),
        unless it is inside another such module with a forward of its own (design.md §4.4:
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
                self._release_finished(worker)
                return
            worker.quiet_refused = True  # gradients after all: the caller learns, and reruns
        self.sender.send(
            caller, [GRAD_IN, worker.microbatch, call_id, *present], [grads[i] for i in present]
        )
        self._release_finished(worker)


def _add(store: dict, key: int, grad: torch.Tensor) -> None:
    store[key] = store[key] + grad if key in store else grad

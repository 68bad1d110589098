"""The owner's side of a remote call (design.md §4.3, §4.8, §4.6): serving REQUESTs and FETCHes.

A REQUEST becomes a served worker (:meth:`ServingMixin._served_worker`) that starts once every
input it takes by reference to an earlier call's output is computed and every input fetched
from a third stage has arrived. Its forward runs the real module and notes the arguments it
changed; its REPLY carries the outputs' structure and, unless the caller fetches them when used,
the outputs. A FETCH asks for the outputs of a call this stage served. A quiet call is answered
only when it went otherwise (Note [Quiet calls], smp.pipeline.protocol).

:class:`ServingMixin` is this part of ``PipelineRuntime`` (smp.pipeline.runtime), which composes
it and sets up the state its methods use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smp.core import messages
from smp.memory import activations, offload
from smp.pipeline.calls import _Lazy, _resolve_results
from smp.pipeline.context import CallMode
from smp.pipeline.protocol import _ARGUMENT, _FETCH, _QUIET, REPLY, _fetch_header
from smp.pipeline.workers import _ArgumentFetch, _PeerFetch, _Worker


def _call_and_note_changes(module: nn.Module, args: tuple, kwargs: dict, values: list, worker):
    """Runs a served call. Returns (outputs, changed, written): the arguments whose state the
    forward changed (a cache it appended to), as ``[(position or keyword, value)]``, and the
    request tensors whose data it changed in place (their version counter moved), as
    ``[(request slot, new data)]``, for the caller to take over (design.md §4.6). Notes on
    ``worker`` which tensors came with the request, so that a tensor handed back unchanged
    travels as a reference to the caller's own (``messages.Sent``)."""
    watched = [*enumerate(args), *kwargs.items()]
    before = [(where, v, messages.fingerprint(v)) for where, v in watched]
    versions = [
        v._version if isinstance(v, torch.Tensor) and not isinstance(v, _Lazy) else None
        for v in values
    ]
    output = activations.call(
        module, args, kwargs, (worker.mode.checkpoint, worker.mode.preserve_rng)
    )
    changed = [(w, v) for w, v, fp in before if fp is not None and messages.fingerprint(v) != fp]
    written = [
        (slot, value)
        for slot, (value, version) in enumerate(zip(values, versions))
        if version is not None and value._version != version
    ]
    # Arguments fetched when read (Note [Arguments fetched when read]): their values count as
    # the request's tensors, the placeholders too.
    written += [(s, v) for s, v, version in worker.fetched_arguments if v._version != version]
    worker.sent_ids = {id(v): i for i, v in enumerate(values) if isinstance(v, torch.Tensor)}
    worker.sent_ids.update((id(v), s) for s, v, _ in worker.fetched_arguments)
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


class ServingMixin:
    """The owner's side of remote calls, for ``PipelineRuntime``: served workers, their
    inputs (references, FETCHes from a third stage), their REPLY, FETCHes of their outputs,
    and the quiet calls this stage serves (Note [Quiet calls])."""

    def _serve(self, worker_id: int, peer: int, header: list[int], tensors) -> None:
        """A REQUEST: runs the owned module's real forward on the caller's values, once every
        output of this rank's earlier calls that it takes by reference is computed and every
        input fetched from a third stage is here. A FETCH (``[REQUEST, mb, fetch id, -1, grad,
        1, 1, 0, caller, call id, slot]``) asks for the outputs of a call this rank served: from
        its caller (caller -1) all of them, from a third stage output ``slot``; they are sent
        once known."""
        if header[3] == _FETCH:
            caller, call_id = header[8], header[9]
            if caller == _ARGUMENT:
                self._answer_argument_fetch(peer, header)
                return
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

    def _answer_argument_fetch(self, peer: int, header: list[int]) -> None:
        """A FETCH of an argument tensor this stage kept for its call ``header[9]`` (Note
        [Arguments fetched when read]): it goes with the request from now on."""
        call_id, slot = header[9], header[10]
        key, kept = self.kept_arguments.get(call_id, (None, {}))
        if slot not in kept:
            raise RuntimeError(
                f"smp: stage {peer} asked for argument tensor {slot} of call {call_id}, which "
                "this stage does not keep (an internal error)"
            )
        reads = self.argument_reads.get(key)
        if reads is not None:
            reads.add(slot)
        self.sender.send(peer, [REPLY, header[1], header[2]], [kept[slot]])

    def _fetch_argument(self, lazy: _Lazy) -> None:
        """In the served call ``lazy`` came to: its value, from the caller's stage (or from the
        fetch of another call of this step that took it by reference), as a leaf of this call."""
        worker = lazy._smp_worker
        value = self.fetched_values.get(lazy._smp_source)
        if value is None:
            if worker.quiet and not worker.quiet_refused:
                self._refuse_quiet(worker)  # its caller, which does not wait, must answer
            stage, call_id, slot = lazy._smp_source
            mb = worker.microbatch
            fetch = _ArgumentFetch(worker, next(self._call_ids))
            self._expect_reply(fetch, fetch.fetch_id, mb)
            worker.replies_due += 1
            self.sender.send(
                stage, _fetch_header(mb, fetch.fetch_id, False, _ARGUMENT, call_id, slot), []
            )
            worker.wait_for(fetch)
            value = self.fetched_values[lazy._smp_source] = fetch.value
        value = value.detach()  # its own leaf: the gradient goes back with this call's
        if worker.grad and lazy._smp_grad:
            value.requires_grad_(True)
            worker.boundary[id(value)] = value
            at = next(i for i, (_, t) in enumerate(worker.input_leaves) if t is lazy)
            worker.input_leaves[at] = (lazy._smp_slot, value)
        worker.fetched_arguments.append((lazy._smp_slot, value, value._version))
        lazy._smp_data = value

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
            elif ref is not None and ref[0] == messages.CALLER:  # kept there until read
                lazy = _Lazy(worker, (peer, ref[1], ref[2]), slot.index, slot.requires_grad)
                worker.received[slot.index] = lazy  # a later request may name it
                values.append(lazy)
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
                held = producer.received[in_slot]
                if isinstance(held, _Lazy):  # still kept by the caller
                    values.append(_Lazy(worker, held._smp_source, slot.index, slot.requires_grad))
                else:
                    values.append(held.detach())
            else:
                worker.received[slot.index] = payload[0]
                values.append(payload.pop(0))
        worker.input_leaves = []
        for slot, tensor in zip(slots, values):
            if tensor is not None and slot.requires_grad and worker.grad:
                if not isinstance(tensor, _Lazy):  # (a placeholder's leaf is its fetched value)
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
            results = _call_and_note_changes(module, args, kwargs, values, worker)
            # Placeholders of arguments it did not read go back as the caller's own tensors.
            keep = frozenset(id(v) for v in values if isinstance(v, _Lazy))
            return _resolve_results(results, keep)

        worker.target = target
        for waiting in self.early_fetches.pop((peer, call_id), []):
            self._answer_fetch(worker, *waiting)
        return worker

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
        # (A call that fetched an argument does not count as calling no other stage: its
        # caller must stay to answer, Note [Arguments fetched when read].)
        alone = worker.calls_made == 0 and not worker.fetched_arguments
        reply = [REPLY, worker.microbatch, call_id, int(alone)]
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

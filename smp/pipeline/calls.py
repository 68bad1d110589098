"""The caller's side of a remote call (design.md §4.3, §4.6): requests, replies, futures.

A module owned by another stage gets a class whose ``__call__`` sends REQUEST to its owner
(:meth:`CallsMixin._install_stubs`). A call of the leader's step function whose output structure
is known returns futures (:class:`_Future`) at once; any other call suspends its worker until the
REPLY. Outputs enter the caller's graph as boundary leaves; arguments the owner changed are
written back into the caller's objects. An op on futures may run on the stage that holds their
values (Note [Ops on futures run where the value is]), and a tensor goes to an owner once per
microbatch (Note [Tensors sent once]).

:class:`CallsMixin` is this part of ``PipelineRuntime`` (smp.pipeline.runtime), which composes it
and sets up the state its methods use.
"""

from __future__ import annotations

import weakref
from collections.abc import MutableMapping

import torch
from torch import nn

from smp import _C
from smp.core import messages, tree
from smp.pipeline import segments
from smp.pipeline.context import CallMode
from smp.pipeline.protocol import _QUIET, REQUEST, _fetch_header
from smp.pipeline.workers import (
    _Abort,
    _ArgumentFetch,
    _Call,
    _current,
    _mix,
    _PeerFetch,
    _Worker,
)


class CallStructureChanged(RuntimeError):
    """A module returned outputs of another structure than its earlier calls with the same
    arguments, after the caller had continued with the predicted structure (design.md §4.3).
    ``smp.step`` runs such a step again when it can restore what the attempt changed; the
    module's calls wait for their outputs from then on (its key is never predicted again)."""


class _Future(torch.Tensor):
    """An output of an asynchronous remote call (design.md §4.3) before or after it arrives.

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


class _Lazy(_Future):
    """An argument tensor of a served call that its caller kept (Note [Arguments fetched when
    read]): fetched from the caller's stage the first time the call uses it as a tensor, then
    its own leaf in this call, as a tensor the request had brought would be."""

    _smp_kept = True  # what smp.core.messages asks a placeholder that it must not read

    @staticmethod
    def __new__(cls, worker: _Worker, source: tuple[int, int, int], slot: int, grad: bool):
        lazy = torch.Tensor._make_subclass(cls, _EMPTY, False)
        lazy._smp_call = None
        lazy._smp_worker = worker  # the served call it came to
        lazy._smp_source = source  # (caller stage, call id, request slot): where it is kept
        lazy._smp_slot = slot  # its slot in this call's request
        lazy._smp_grad = grad  # the slot's requires_grad flag
        lazy._smp_data = None  # its value here, once fetched
        return lazy

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func == _DEVICE_GET:  # where a tensor of the request lands: no need to fetch it
            return args[0]._smp_worker.runtime.state.device
        args, kwargs = _resolve_tree((args, kwargs or {}))
        return func(*args, **kwargs)

    def _smp_value(self) -> torch.Tensor:
        if self._smp_data is None:
            worker = self._smp_worker
            if getattr(_current, "worker", None) is not worker:  # (None once it finished)
                stage, _, slot = self._smp_source
                raise RuntimeError(
                    f"smp: argument tensor {slot} that stage {stage} passed to module "
                    f"'{worker.module_path}' (microbatch {worker.microbatch}) was first read "
                    "outside that call's forward; the caller keeps a tensor the module did not "
                    "read in its earlier calls until then (design.md §4.6). Keep a copy "
                    "(x.clone()) in the forward if the module reads it later"
                )
            worker.runtime._fetch_argument(self)
        return self._smp_data


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

# Note [Arguments fetched when read]
# A tensor that a module on another stage does not read need not travel: the first call of a
# Hugging Face decoder layer on stage 1 carried the DynamicCache with the keys and values of
# every layer of stage 0 (1280 KiB of that call's 1570 on the benchmark's Llama), and the layer
# reads only its own. A request's tensors of at least _KEEP_MIN bytes that the owner did not
# read in an earlier call with the same key (owner, module, argument structure) stay with the
# caller: it keeps a copy (taken when the call is made, as a sent tensor's is, so the caller may
# change its own in place afterwards) until the step ends, and sends a Ref (messages.CALLER).
# The owner gives the call a placeholder (_Lazy) that, at its first use as a tensor, FETCHes
# the copy (protocol._ARGUMENT) while the call waits, as for a future; from then on it is that
# value, a leaf whose gradient goes back with the call's GRAD_IN, and a change in place is
# written back as for a tensor the request had brought. What is read is learned from the
# FETCHes: a slot fetched once goes with the request from then on. A new key's first call keeps
# every such tensor, so its reads cost one round trip each, once: at most _KEPT_STRUCTURES keys
# per module are learned (a module whose arguments carry a changing Python value makes a new key
# per call), later ones send everything. Exact whatever was learned: a kept tensor that is read
# is fetched. A placeholder passed to a module positionally counts as read (the forward
# pre-hook resolves those, for C++ extensions), one inside a list, dict or object does not.
# An unread placeholder handed back travels as the caller's own tensor
# (messages.Sent); one read outside its call's forward (a backward's recomputation, a later
# step) is an error naming it. Not with TP (no predictions there either, and the TP ranks of a
# stage must exchange the same messages); a placeholder passed on to a third stage is fetched
# first. A call that fetched one is not quiet (Note [Quiet calls]): its caller must stay to
# answer.
_KEEP_MIN = 64 * 1024  # bytes: smaller tensors always travel with the request
_KEPT_STRUCTURES = 8  # keys per (owner, module) whose unread tensors are learned


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
            if call is None or call.worker is not worker or call.values is not None:
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
        seen: set = set()
        resolved = tuple(_resolve_in_place(a, seen, False) for a in args)
        return None if all(new is old for new, old in zip(resolved, args)) else resolved
    return None


def _resolve_in_place(value, seen: set, nested: bool = True):
    """``value`` with every future replaced by its value. Lists and dicts change in place and
    stay the caller's objects (a module may append to a list it is given, as in one process);
    tuples are rebuilt only where they held a future; other objects are kept. A kept argument
    (:class:`_Lazy`) is fetched only where it is not ``nested`` in a container: a module reads
    a tensor it is given, not necessarily every tensor of a cache it is given (Note [Arguments
    fetched when read])."""
    if isinstance(value, _Future):
        return value if nested and isinstance(value, _Lazy) else value._smp_value()
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


def _resolve_results(value, keep: frozenset[int] = frozenset()):
    """A step function's or served call's results with every future replaced by its value,
    inside any object too (a cache, a dataclass: rebuilt, smp.core.tree's ``objects``), except
    the placeholders whose ids are in ``keep`` (a served call's own arguments, which go back as
    the caller's tensors: Note [Arguments fetched when read])."""
    if not keep:
        return tree.map_tensors(_resolve, value, objects=True)
    return tree.map_tensors(lambda v: v if id(v) in keep else _resolve(v), value, objects=True)


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


class CallsMixin:
    """The caller's side of remote calls, for ``PipelineRuntime``: stubs, REQUEST, REPLY,
    FETCH of outputs not pushed, and write-back of changed arguments."""

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
        futures at once (design.md §4.3); any other call suspends the worker until REPLY."""
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
                if call is not None and call.worker.runtime is self:
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
        kept: dict[int, torch.Tensor] = {}  # slot -> a tensor kept here until read
        if self.keep_unread and self.order_group is None:
            kept = self._keep_unread(owner, index, unpacked.blob, tensors, call_id)
        refs = [(i, t) for i, t in enumerate(tensors) if isinstance(t, messages.Ref)]
        real = [t for t in tensors if not isinstance(t, messages.Ref)]
        if self.send_once:
            for i, t in enumerate(tensors):
                t = kept.get(i, t)
                # (An inference tensor keeps no version counter: it is sent every time.)
                if not isinstance(t, messages.Ref) and not t.is_inference():
                    held[id(t)] = (weakref.ref(t), t._version, call_id, i)
        mode = CallMode.current()
        grad = mode.grad
        # The owner's input leaves, in slot order: what it sends and what it already holds.
        inputs = [
            again.get(i, kept.get(i, t))
            for i, t in enumerate(tensors)
            if i in again or i in kept or not isinstance(t, messages.Ref)
        ]
        sent = [t for t in inputs if t.requires_grad] if grad else []
        path = self.paths[index] or "<root>"
        call = _Call(call_id, owner, worker, grad, sent, [segments.edge_of(t) for t in sent], path)
        worker.calls.append(call)
        prediction = None
        quiet = False
        # With tensor parallelism every decision here must be the same on every TP rank of the
        # stage (they run one task order, design.md §6.4), but their arguments may differ (a
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

    def _keep_unread(self, owner: int, index: int, blob: bytes, tensors: list, call_id: int):
        """Replaces, in ``tensors``, those the owner did not read in earlier calls with this key
        by Refs to this call's slots, and keeps copies of them to answer FETCHes (Note
        [Arguments fetched when read]). Returns {slot: the caller's tensor} of those kept."""
        key = (owner, index, blob)
        reads = self.argument_reads.get(key)
        if reads is None:
            learned = self.kept_structures.get((owner, index), 0)
            if learned >= _KEPT_STRUCTURES:
                return {}
            self.kept_structures[(owner, index)] = learned + 1
            reads = self.argument_reads[key] = set()
        kept = {
            i: t
            for i, t in enumerate(tensors)
            if not isinstance(t, messages.Ref)
            and i not in reads
            and t.numel() * t.element_size() >= _KEEP_MIN
        }
        if kept:
            self.kept_arguments[call_id] = (key, {i: t.detach().clone() for i, t in kept.items()})
            for i, t in kept.items():
                tensors[i] = messages.Ref(call_id, i, messages.CALLER, t.requires_grad)
        return kept

    @staticmethod
    def _write_back(owner: int, path: str, original: torch.Tensor, value: torch.Tensor) -> None:
        """Gives the caller's tensor ``original`` the data that the module on stage ``owner``
        left in its copy of it, as one process would have changed it (design.md §4.6)."""
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
        if isinstance(call, _ArgumentFetch):  # an argument its caller kept, for a served call
            call.value = message[2][0]
            self._replied(call.worker, call)
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
            "design.md §4.3). "
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
            "pipeline calls, design.md §4.3). The module's calls are waited for from now on; "
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
            if not worker.resuming:  # else it resumes itself (Note [Direct resumes])
                self._grant(worker)
        elif worker.served is None:
            self._maybe_finish_microbatch(worker.microbatch)
        elif worker.finished and not worker.replies_due:
            self._reply(worker)

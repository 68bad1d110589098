"""``smp.DistributedOptimizer``: the user's torch optimizer, with smp's methods (api.md §4).

As in SMP v1, ``smp.DistributedOptimizer(optimizer)`` returns ``optimizer`` itself, its class
swapped for a subclass of both its own class and :class:`DistributedOptimizer`: it stays a
``torch.optim.Optimizer`` (and an ``AdamW``, ...), so LR schedulers and any code that checks the
type take it. Gradients reaching ``step()`` are already reduced by ``smp.step``; the overrides
add ``clip_grad_norm_`` over the global gradient norm and make ``state_dict()`` the full state
(gathered over the pipeline and tensor-parallel groups) with ``local_state_dict()`` this rank's.

With ``shard_optimizer_state`` (ZeRO-1) every parameter of a stage belongs to one rank of the
group holding the same parameters (rdp, :func:`balance_owners`): only its owner keeps its
optimizer state and updates it, then broadcasts the new values to the group.
"""

from __future__ import annotations

import heapq
import logging
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from smp import amp
from smp.checkpoints.keys import MASTER_KEY, PARTIAL_KEY, SCALER_KEY, SHARD_KEY
from smp.dp import sharded
from smp.state import get_state

__all__ = ["DistributedOptimizer", "balance_owners"]

logger = logging.getLogger("smp")

_classes: dict[type, type] = {}
_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def balance_owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """The owner (0 .. ranks - 1) of each item of ``sizes``: largest item first (ties: the lower
    index first), each to the least loaded rank so far (ties: the lower rank). Deterministic, so
    every rank computing it from the same sizes gets the same answer. The largest load is at
    most the ideal share ``sum / ranks`` plus one item."""
    if ranks < 1:
        raise ValueError(f"balance_owners: ranks must be >= 1, got {ranks}")
    owners = [0] * len(sizes)
    loads = [(0, rank) for rank in range(ranks)]  # a heap of (load, rank)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + sizes[index], rank))
    return owners


class LossScaler:
    """SMP v1's fp16 loss scale: static, or dynamic with its arguments and defaults.

    Dynamic: starts at ``init_scale``; an overflow lowers it by ``scale_factor`` (not below
    ``min_scale``) once ``delayed_shift`` overflows have been seen (the hysteresis; with
    ``consecutive_hysteresis`` only consecutive ones count), and ``scale_window`` steps in a row
    without one raise it by ``scale_factor``.
    """

    DEFAULTS = dict(
        init_scale=2.0**32,
        scale_factor=2.0,
        scale_window=1000,
        min_scale=1.0,
        delayed_shift=1,
        consecutive_hysteresis=False,
    )

    def __init__(self, static_loss_scale: float | None, dynamic: bool, args: dict[str, Any]):
        unknown = sorted(set(args) - set(self.DEFAULTS))
        if unknown:
            raise ValueError(
                f"smp.DistributedOptimizer: unknown dynamic_loss_args {unknown}; known: "
                f"{sorted(self.DEFAULTS)}"
            )
        options = {**self.DEFAULTS, **args}
        self.dynamic = bool(dynamic)
        if not self.dynamic and (static_loss_scale is None or not static_loss_scale > 0):
            raise ValueError(
                "smp.DistributedOptimizer: static_loss_scale must be > 0 (or dynamic_loss_scale="
                f"True), got {static_loss_scale!r}"
            )
        self.scale = float(options["init_scale"] if self.dynamic else static_loss_scale)
        self.factor = float(options["scale_factor"])
        self.window = int(options["scale_window"])
        self.min_scale = float(options["min_scale"])
        self.delayed_shift = int(options["delayed_shift"])
        self.consecutive = bool(options["consecutive_hysteresis"])
        self.hysteresis = self.delayed_shift
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = 0
            if self.hysteresis <= 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
                self.hysteresis = self.delayed_shift
            else:
                self.hysteresis -= 1
            return
        if self.consecutive:
            self.hysteresis = self.delayed_shift
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= self.factor

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("scale", "hysteresis", "good_steps")}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for key, value in saved.items():
            setattr(self, key, value)


def _distributed_class(cls: type) -> type:
    """``cls`` with DistributedOptimizer's methods first (one class per optimizer class)."""
    if cls not in _classes:
        _classes[cls] = type(
            f"Distributed{cls.__name__}",
            (DistributedOptimizer, cls),
            {"__module__": cls.__module__},
        )
    return _classes[cls]


class DistributedOptimizer(torch.optim.Optimizer):
    """Makes ``optimizer`` smp's: returns the same object, a ``DistributedOptimizer`` now.

    Args:
        optimizer: a torch.optim.Optimizer over the DistributedModel's parameters.
        static_loss_scale, dynamic_loss_scale, dynamic_loss_args: fp16 loss scaling, as in SMP
            v1 (:class:`LossScaler`; the dynamic arguments may also come as keywords); unused
            while ``fp16`` is off, as in v1. With ``fp16`` on, ``model.backward`` scales the
            loss and ``step()`` unscales, skipping the step on every rank when any rank's
            gradients hold an inf or NaN.

    Raises:
        ValueError: ``optimizer`` is not a torch optimizer, or a bad loss-scale argument.
    """

    def __new__(
        cls,
        optimizer: torch.optim.Optimizer | None = None,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        if optimizer is None and cls is not DistributedOptimizer:
            return super().__new__(cls)  # copy.deepcopy rebuilding a Distributed<Optimizer>
        state = get_state()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "smp.DistributedOptimizer wraps a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        args = {**(dynamic_loss_args or {}), **kwargs}  # v1 also takes them as keywords
        scaling = static_loss_scale != 1.0 or dynamic_loss_scale or args
        if scaling and not state.config.fp16:
            logger.info("smp.DistributedOptimizer: loss-scale arguments unused (fp16 is off)")
        if not isinstance(optimizer, DistributedOptimizer):
            optimizer.__class__ = _distributed_class(type(optimizer))
            optimizer._smp_masters = _master_weights(optimizer)
        # This step's model gradients as copied to the master weights ((parameter, gradient,
        # version) each), None until they are: what step, unscaling and clipping read.
        optimizer._smp_copied_grads = None
        optimizer._smp_scaler = None
        optimizer._smp_unscaled = None  # this step's overflow, once unscaled (clip_grad_norm_)
        if state.config.fp16:
            optimizer._smp_scaler = LossScaler(static_loss_scale, dynamic_loss_scale, args)
            state.loss_scale = optimizer._smp_scaler.scale
        state.optimizers.append(optimizer)
        optimizer._take_held_state()  # a resume before this optimizer existed
        return optimizer

    def __init__(self, optimizer: torch.optim.Optimizer | None = None, *args: Any, **kwargs: Any):
        pass  # the optimizer is built already: __new__ returned it as it is

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer itself (smp's earlier wrapper exposed it here)."""
        return self

    def _algorithm_step(self) -> None:
        """The wrapped optimizer class's own ``step``: its algorithm alone, none of smp's
        (checkpoints create a fresh optimizer's state with it)."""
        super().step()

    def step(self, closure=None):
        """One optimizer step on the reduced gradients (call it outside the step function).

        With ``fp16``: the gradients are unscaled first; if any rank has an inf or NaN among its
        gradients, every rank skips the step (and returns None) and a dynamic loss scale drops.
        """
        state = get_state()
        if state.in_step:
            raise RuntimeError(
                "optimizer.step() must be called after the @smp.step function returns, not "
                "inside it"
            )
        self._refuse_torch_scaler(state)
        self._sync_master_grads()
        self._smp_copied_grads = None
        scaler = getattr(self, "_smp_scaler", None)
        if scaler is None:
            return self._step_and_copy_back(closure)
        overflow = self._unscale()
        self._smp_unscaled = None
        before = scaler.scale
        scaler.update(overflow)
        state.loss_scale = scaler.scale
        if overflow:
            if state.rank == 0:
                logger.warning(
                    "smp: fp16 gradients overflowed on some rank; the step is skipped on every "
                    "rank (loss scale %g -> %g)",
                    before,
                    scaler.scale,
                )
            return None
        return self._step_and_copy_back(closure)

    # ---- shard_optimizer_state (ZeRO-1) ---------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _shard_owners(self) -> list[int | None] | None:
        """With ``shard_optimizer_state`` over more than one rdp rank: the rdp rank that owns
        each optimizer parameter (by its index in the groups; None for a parameter another
        pipeline stage holds), else None. Computed from the parameters' sizes alone, the same
        on every rank of the rdp group and of the TP group (a TP shard has the same size on
        every TP rank); recomputed when the live parameters change (a partition releases
        those of other stages)."""
        state = get_state()
        if not state.config.shard_optimizer_state or state.axis_size("rdp") == 1:
            return None
        params = self._params()
        key = tuple(p.numel() for p in params)
        cached = getattr(self, "_smp_shard", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        live = [i for i, n in enumerate(key) if n > 0]
        picks = balance_owners([key[i] for i in live], state.axis_size("rdp"))
        owners: list[int | None] = [None] * len(params)
        for index, rank in zip(live, picks):
            owners[index] = rank
        self._smp_shard = (key, owners)
        return owners

    def _state_kept(self) -> set[int] | None:
        """The ids of the parameters whose optimizer state this rank keeps and updates: None
        (all of them) without ``shard_optimizer_state``, else those it owns."""
        owners = self._shard_owners()
        if owners is None:
            return None
        params = self._params()
        return {id(params[i]) for i in self._owned_indices(owners)}

    def _owned_indices(self, owners: list[int | None]) -> list[int]:
        rank = get_state().axis_rank("rdp")
        return [i for i, owner in enumerate(owners) if owner == rank]

    def _model(self):
        """The newest DistributedModel holding this optimizer's parameters, or None."""
        mine = {id(self.model_parameter(p)) for p in self._params()}
        for model in reversed(list(get_state().models)):
            if any(id(p) in mine for p in model.parameters()):
                return model
        return None

    def _refuse_torch_scaler(self, state) -> None:
        """Raises if torch's own ``GradScaler`` (not ``smp.amp.GradScaler``) is stepping this
        optimizer where it cannot be exact: with float32 masters (it unscaled and checked the
        optimizer's parameters before the masters had this step's gradients, so the step
        would apply scaled gradients) or with pipeline / tensor parallelism (each rank decides
        to skip from its own gradients, so ranks could skip different steps). The scaler is
        found as the ``self`` of a caller a few frames up (its ``step`` or ``_maybe_opt_step``;
        torch wraps this ``step`` once in a profiling hook): a check, not a mechanism, so a
        torch that calls it otherwise only goes unchecked."""
        frame = sys._getframe(2)
        for _ in range(4):
            if frame is None:
                return
            caller = frame.f_locals.get("self") if frame.f_code.co_name in _SCALER_STEPS else None
            if isinstance(caller, torch.amp.GradScaler):
                break
            frame = frame.f_back
        else:
            return
        if isinstance(caller, amp.GradScaler) or not caller.is_enabled():
            return
        masters = bool(getattr(self, "_smp_masters", None))
        split = state.axis_size("pp") * state.axis_size("tp") > 1
        if masters or split:
            why = (
                "it unscales and checks the optimizer's float32 master weights before they "
                "hold this step's gradients, so the step would apply scaled gradients"
                if masters
                else "each rank decides from its own gradients whether to skip the step, and "
                "pipeline stages and tensor-parallel ranks hold different gradients"
            )
            raise ValueError(
                f"smp.DistributedOptimizer is stepped by {type(caller).__module__}."
                f"{type(caller).__qualname__}, which cannot be exact here: {why}. Use "
                "smp.amp.GradScaler (the same API, with the overflow decision agreed by every "
                "rank and the masters' gradients taken first)"
            )

    def _take_held_state(self) -> None:
        """Loads the optimizer state that ``smp.resume_from_checkpoint`` held on this
        optimizer's model because no DistributedOptimizer existed over it yet (a collective for
        a partial checkpoint; every rank creates its optimizer). The checkpoint code leaves the
        held state on the model as an object with ``load_into(model, optimizer)``, so this layer
        needs nothing from it."""
        model = self._model()
        held = getattr(model, "_smp_held_optimizer_state", None)
        if held is not None:
            model._smp_held_optimizer_state = None
            held.load_into(model, self)

    def _partitioned(self) -> bool:
        model = self._model()
        return model is None or model.partitioned

    def _drop_unowned_state(self, owners: list[int | None]) -> None:
        """Frees the state of every parameter this rank does not own (e.g. a full state loaded
        before the partition decided the owners)."""
        owned = set(self._owned_indices(owners))
        for index, p in enumerate(self._params()):
            if index not in owned:
                self.state.pop(p, None)

    def _sharded_step(self, closure, owners: list[int | None]):
        """The optimizer's own step on the parameters this rank owns (the others' gradients
        are hidden: torch optimizers skip a parameter without one and create no state for it),
        then every owner's new values broadcast over the rdp group."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._drop_unowned_state(owners)
        owned = set(self._owned_indices(owners))
        hidden = []
        for index, p in enumerate(self._params()):
            if index not in owned and p.grad is not None:
                hidden.append((p, p.grad))
                p.grad = None
        try:
            super().step()
        finally:
            for p, grad in hidden:
                p.grad = grad
        self._broadcast_owned(owners)
        return loss

    def _broadcast_owned(self, owners: list[int | None]) -> None:
        """Every owner's trainable parameters to the rest of the rdp group: per owner (in rdp
        order) and per dtype, flat buffers of at most the model's ``bucket_cap_mb``; every rank
        issues the same broadcasts in the same order."""
        state = get_state()
        group = state.groups["rdp"]
        me = state.axis_rank("rdp")
        model = self._model()
        cap = model.bucket_bytes if model is not None else _DEFAULT_BUCKET_BYTES
        params = self._params()
        with torch.no_grad():
            for owner in range(state.axis_size("rdp")):
                src = state.world_rank_of("rdp", owner)
                kinds: dict[tuple, list[torch.Tensor]] = {}
                for index, p in enumerate(params):
                    if owners[index] == owner and p.requires_grad:
                        kinds.setdefault((p.dtype, p.device), []).append(p.detach())
                for tensors in kinds.values():
                    for bucket in _buckets(tensors, cap):
                        if owner == me:
                            flat = _flatten_dense_tensors(bucket)
                        else:
                            size = sum(t.numel() for t in bucket)
                            flat = torch.empty(size, dtype=bucket[0].dtype, device=bucket[0].device)
                        dist.broadcast(flat, src=src, group=group)
                        if owner != me:
                            for t, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                                t.copy_(value)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds (every tensor in ``self.state`` once):
        with ``shard_optimizer_state`` or sharded data parallelism, this rank's shard. Float32
        master weights of a low-precision model are parameters of the optimizer, not state:
        not counted."""
        seen: set[int] = set()
        total = 0
        for entry in self.state.values():
            for value in entry.values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    value = sharded.local_part(value)  # a sharded one: this rank's chunk
                    total += value.numel() * value.element_size()
        return total

    # ---- float32 master weights of a low-precision model ------------------------------------

    def _step_and_copy_back(self, closure):
        owners = self._shard_owners()
        if owners is None:
            result = super().step(closure)
        else:
            result = self._sharded_step(closure, owners)
        masters = getattr(self, "_smp_masters", None)
        if masters:
            with torch.no_grad():
                for master, param in masters.values():
                    if param.numel() > 0:
                        param.copy_(master)
        return result

    def _sync_master_grads(self) -> None:
        """Gives each float32 master weight its model parameter's gradient, in float32 (once per
        step: clipping and unscaling then work on these)."""
        masters = getattr(self, "_smp_masters", None)
        if not masters:
            return
        if self._smp_copied_grads is not None:
            self._check_model_grads_unchanged()
            return
        copied = []
        for master, param in masters.values():
            master.grad = None if param.grad is None else param.grad.detach().float()
            # What was copied, by identity and version counter (an in-place change bumps it):
            # a change after this copy would be lost, so it raises (no sync, no collective).
            copied.append((param, param.grad, None if param.grad is None else param.grad._version))
        self._smp_copied_grads = copied

    def _check_model_grads_unchanged(self) -> None:
        """Raises MasterGradientsChangedError if a low-precision parameter's gradient changed
        since it was copied into its float32 master this step."""
        changed = [
            param
            for param, grad, version in self._smp_copied_grads
            if param.grad is not grad or (grad is not None and grad._version != version)
        ]
        if not changed:
            return
        model = self._model()
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        shown = ", ".join(names.get(id(p), f"a {p.dtype} {list(p.shape)}") for p in changed[:3])
        raise MasterGradientsChangedError(
            f"smp.DistributedOptimizer: the gradient of {len(changed)} low-precision model "
            f"parameter(s) ({shown}{', ...' if len(changed) > 3 else ''}) changed after this "
            "step's gradients were copied into the optimizer's float32 master weights (by "
            "scaler.unscale_(optimizer), optimizer.clip_grad_norm_ or fp16 unscaling), so the "
            "step would not see the change; e.g. torch.nn.utils.clip_grad_norm_(model."
            "parameters()) after scaler.unscale_(optimizer) clips the still-scaled float16 "
            "gradients, not the masters. Clip with optimizer.clip_grad_norm_(max_norm) (the "
            "masters' unscaled gradients, global norm over every rank), and change the model's "
            "gradients only before unscaling."
        )

    def _release_masters(self) -> None:
        """Frees the master weights of parameters another pipeline stage owns (their model
        parameters were released by the partition)."""
        for master, param in getattr(self, "_smp_masters", {}).values():
            if param.numel() == 0 and master.numel() > 0:
                master.data = torch.empty(0, dtype=master.dtype, device=master.device)
                self.state.pop(master, None)

    def _refresh_masters(self, params=None) -> None:
        """Copies model parameters into their master weights (after a model state was loaded
        without them)."""
        with torch.no_grad():
            for master, param in getattr(self, "_smp_masters", {}).values():
                if param.numel() > 0 and (params is None or id(param) in params):
                    # Made from a delayed parameter's placeholder, or before the partition
                    # moved the parameter to this rank's device.
                    if master.shape != param.shape or master.device != param.device:
                        master.data = torch.empty_like(param, dtype=master.dtype)
                    master.copy_(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._smp_copied_grads = None  # and their references: set_to_none frees them
        for _, param in getattr(self, "_smp_masters", {}).values():
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    def model_parameter(self, param: torch.Tensor) -> torch.Tensor:
        """The model's parameter behind an optimizer parameter (itself, or the parameter a
        float32 master weight stands for)."""
        entry = getattr(self, "_smp_masters", {}).get(id(param))
        return param if entry is None else entry[1]

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        scaler = getattr(self, "_smp_scaler", None)
        return 1.0 if scaler is None else scaler.scale

    def _unscale(self) -> bool:
        """Divides this step's gradients by the loss scale (once) and tells whether any rank
        found an inf or NaN among its gradients (one all-reduce over the world)."""
        if self._smp_unscaled is not None:
            return self._smp_unscaled
        self._sync_master_grads()
        state = get_state()
        inverse = 1.0 / self._smp_scaler.scale
        bad = torch.zeros(1, dtype=torch.float32, device=state.device)
        for grad in self._grads():
            grad.mul_(inverse)
            bad = torch.maximum(bad, (~torch.isfinite(grad)).any().float().reshape(1))
        if state.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=state.groups["world"])
        self._smp_unscaled = bool(bad.item() > 0)
        return self._smp_unscaled

    def _grads(self) -> list[torch.Tensor]:
        """The gradients of this optimizer's parameters, each once (tied parameters share one)."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return list({id(g): g for g in grads}.values())

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state: its stage's parameters, its tensor-parallel shards, and
        v1's marker ``"_smp_is_partial": True`` (``load_state_dict`` takes it back on the same
        layout). Under fp16 both state dicts also hold the loss scale (``SCALER_KEY``); float32
        master weights of a low-precision model are their parameters' ``MASTER_KEY`` entries.
        With ``shard_optimizer_state``: the entries of the parameters this rank owns only, and
        their indices under ``SHARD_KEY`` (a load checks them)."""
        packed = self._with_masters(super().state_dict())
        owners = self._shard_owners()
        if owners is None:
            return {**packed, **self._scaler_state(), PARTIAL_KEY: True}
        owned = self._owned_indices(owners)
        entries = {i: e for i, e in packed["state"].items() if i in set(owned)}
        return {
            **packed,
            "state": entries,
            **self._scaler_state(),
            SHARD_KEY: owned,
            PARTIAL_KEY: True,
        }

    def _with_masters(self, packed: dict[str, Any]) -> dict[str, Any]:
        """A packed state with each float32 master weight as its parameter's ``MASTER_KEY``
        entry (torch's state dict holds state, not parameters)."""
        masters = getattr(self, "_smp_masters", None)
        if not masters:
            return packed
        entries = dict(packed["state"])
        params = [p for group in self.param_groups for p in group["params"]]
        for index, p in enumerate(params):
            if id(p) in masters and p.numel() > 0:
                entries[index] = {**entries.get(index, {}), MASTER_KEY: p.detach()}
        return {**packed, "state": entries}

    def _load_masters(self, entries: dict) -> dict:
        """Copies ``MASTER_KEY`` entries into the master weights; the entries without them."""
        params = [p for group in self.param_groups for p in group["params"]]
        out = {}
        for index, entry in entries.items():
            entry = dict(entry)
            value = entry.pop(MASTER_KEY, None)
            if value is not None:
                with torch.no_grad():
                    params[int(index)].copy_(value)
            if entry:
                out[index] = entry
        return out

    def _scaler_state(self) -> dict[str, Any]:
        scaler = getattr(self, "_smp_scaler", None)
        return {} if scaler is None else {SCALER_KEY: scaler.state_dict()}

    def _load_scaler_state(self, state_dict: dict[str, Any]) -> None:
        scaler = getattr(self, "_smp_scaler", None)
        if scaler is not None and SCALER_KEY in state_dict:
            scaler.load_state_dict(state_dict[SCALER_KEY])
            get_state().loss_scale = scaler.scale

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state, as one process training the whole model would hold it:
        every stage's entries, tensor-parallel shards joined to full shapes. A collective over
        the pipeline and tensor-parallel groups (and with ``shard_optimizer_state`` the rdp
        group): every rank must call it."""
        local = self._with_masters(super().state_dict())
        state = get_state()
        params = self._params()
        entries = local["state"]
        owners = self._shard_owners()
        if owners is not None:  # each rank's own entries; masters from their owners too
            owned = set(self._owned_indices(owners))
            entries = {i: e for i, e in entries.items() if i in owned}
        if sharded.enabled():  # whole tensors (collectives in index and key order)
            entries = {
                i: {k: sharded.full(v) for k, v in sorted(entries[i].items())}
                for i in sorted(entries)
            }
        entries = _unshard(entries, params, state)
        if owners is not None:
            entries = {i: {k: _cpu(v) for k, v in e.items()} for i, e in entries.items()}
            parts: list[Any] = [None] * state.axis_size("rdp")
            dist.all_gather_object(parts, entries, group=state.groups["rdp"])
            entries = {i: e for part in parts for i, e in part.items()}
        if state.axis_size("pp") > 1:
            entries = {i: {k: _cpu(v) for k, v in e.items()} for i, e in entries.items()}
            stages: list[Any] = [None] * state.axis_size("pp")
            dist.all_gather_object(stages, entries, group=state.groups["pp"])
            entries = {i: e for part in stages for i, e in part.items()}
        return {
            "state": dict(sorted(entries.items())),
            "param_groups": local["param_groups"],
            **self._scaler_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a full state (from :meth:`state_dict`, or one process's optimizer over the
        same model): each rank takes its stage's entries and its tensor-parallel shards, and
        with ``shard_optimizer_state`` only those of the parameters it owns (float32 master
        weights: all of its stage's), so a state saved at one data-parallel degree loads at
        another. A partial state (from :meth:`local_state_dict`) is this rank's own: it loads
        as it is, on the layout that saved it.

        Raises:
            ValueError: a partial state saved with other owners (another rdp degree, or with
                ``shard_optimizer_state`` on one side only).
        """
        owners = self._shard_owners()
        if state_dict.get(PARTIAL_KEY, False):
            self._check_shard(state_dict.get(SHARD_KEY), owners)
            self._load_scaler_state(state_dict)
            drop = (PARTIAL_KEY, SCALER_KEY, SHARD_KEY)
            local = {k: v for k, v in state_dict.items() if k not in drop}
            local["state"] = self._load_masters(local["state"])
            return super().load_state_dict(local)
        self._load_scaler_state(state_dict)
        state = get_state()
        params = self._params()
        live = {i for i, p in enumerate(params) if p.numel() > 0}
        entries = {i: e for i, e in state_dict["state"].items() if int(i) in live}
        entries = _shard(entries, params, state)
        if sharded.enabled():  # this rank's chunk of each sharded parameter's state
            entries = {
                i: {k: sharded.like(v, params[int(i)]) for k, v in e.items()}
                for i, e in entries.items()
            }
        entries = self._load_masters(entries)
        if owners is not None and self._partitioned():
            # Before a partition the owners are not final: the first step drops the others.
            owned = set(self._owned_indices(owners))
            entries = {i: e for i, e in entries.items() if int(i) in owned}
        super().load_state_dict({"state": entries, "param_groups": state_dict["param_groups"]})

    def _check_shard(self, saved: list[int] | None, owners: list[int | None] | None) -> None:
        if not self._partitioned():
            return  # the owners are decided by the partition; the first step checks nothing
        mine = None if owners is None else self._owned_indices(owners)
        if saved is not None:
            saved = [int(i) for i in saved]
        if saved != mine:
            state = get_state()
            raise ValueError(
                "optimizer.load_state_dict: this partial state (local_state_dict) holds the "
                f"optimizer state of parameters {_brief(saved)}, but this rank (rdp rank "
                f"{state.axis_rank('rdp')} of {state.axis_size('rdp')}, shard_optimizer_state="
                f"{state.config.shard_optimizer_state}) keeps {_brief(mine)}: a partial state "
                "loads on the layout that saved it; save state_dict() (full) to load on another"
            )

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """SMP v1's clipping of the fp32 master gradients (its fp16 optimizer): smp's are the
        parameters' own fp32 gradients, so this is :meth:`clip_grad_norm_` (which unscales them
        first under fp16)."""
        return self.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scales every gradient so the global ``norm_type`` norm is at most ``max_norm``.

        The norm is taken over the gradients of all ranks of the model replica (the mp group);
        data-parallel replicas hold identical reduced gradients and are not counted twice.

        Returns:
            The global norm before clipping.
        """
        if not max_norm > 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm!r}")
        self._sync_master_grads()
        if getattr(self, "_smp_scaler", None) is not None and self._unscale():
            return torch.tensor(float("inf"))  # an overflow: step() skips this step anyway
        state = get_state()
        grads = all_grads = self._grads()
        # Gradients are identical across the TP group except shards of split parameters: count
        # the others once per model replica, on TP rank 0.
        if state.axis_size("tp") > 1 and state.axis_rank("tp") != 0:
            shard_grads = {
                id(p.grad)
                for group in self.param_groups
                for p in group["params"]
                if p.grad is not None and getattr(p, "_smp_tp_split", None) is not None
            }
            grads = [g for g in grads if id(g) in shard_grads]
        device = grads[0].device if grads else state.device
        grads = [sharded.local_part(g) for g in grads]  # a sharded one: this rank's chunk
        if math.isinf(norm_type):
            local = max((g.detach().abs().max() for g in grads), default=torch.zeros(()))
            total = local.to(device=device, dtype=torch.float32).reshape(1)
            sharded.sum_over_shards(total, op=dist.ReduceOp.MAX)
            if state.axis_size("mp") > 1:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=state.groups["mp"])
            norm = total[0]
        else:
            powers = [g.detach().float().norm(norm_type) ** norm_type for g in grads]
            total = torch.stack(powers).sum() if powers else torch.zeros((), device=device)
            total = total.reshape(1)
            sharded.sum_over_shards(total)
            if state.axis_size("mp") > 1:
                dist.all_reduce(total, group=state.groups["mp"])
            norm = total[0] ** (1.0 / norm_type)
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1:
            for g in all_grads:
                sharded.local_part(g).detach().mul_(coefficient.to(g.dtype))
        return norm


_LOW_PRECISION = (torch.float16, torch.bfloat16)
# The functions of torch's GradScaler that call optimizer.step().
_SCALER_STEPS = frozenset({"step", "_maybe_opt_step"})


class MasterGradientsChangedError(RuntimeError):
    """A low-precision model's gradients changed after they were copied into the optimizer's
    float32 master weights (the step would silently not see the change)."""


def _master_weights(optimizer: torch.optim.Optimizer) -> dict[int, tuple[torch.Tensor, Any]]:
    """Replaces every float16 / bfloat16 parameter in the optimizer's groups with a float32
    master copy (a leaf carrying the parameter's smp attributes), which the optimizer updates;
    ``step()`` copies it back into the parameter. Returns {id(master): (master, parameter)}."""
    masters: dict[int, tuple[torch.Tensor, Any]] = {}
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if p.dtype not in _LOW_PRECISION:
                params.append(p)
                continue
            master = torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
            for attr in ("_smp_tp_split", "_smp_tp_reduce"):
                if hasattr(p, attr):
                    setattr(master, attr, getattr(p, attr))
            saved = optimizer.state.pop(p, None)
            if saved:
                optimizer.state[master] = {
                    k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                    for k, v in saved.items()
                }
            masters[id(master)] = (master, p)
            params.append(master)
        group["params"] = params
    return masters


def _brief(indices: list[int] | None) -> str:
    if indices is None:
        return "all (no sharding)"
    shown = ", ".join(str(i) for i in indices[:6])
    return f"[{shown}{', ...' if len(indices) > 6 else ''}] ({len(indices)})"


def _buckets(tensors: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut into runs of at most ``cap`` bytes (a larger tensor alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _split_of(param: torch.Tensor) -> tuple[int, int] | None:
    return getattr(param, "_smp_tp_split", None)


def _unshard(entries: dict, params: list, state) -> dict:
    """Optimizer state with each tensor shaped like a TP-split parameter's shard joined to the
    full shape (an all-gather over the TP group per tensor, in index order on every TP rank)."""
    if state.axis_size("tp") == 1:
        return entries
    from smp.core.shards import gather_shards

    group = state.groups["tp"]
    out = {}
    for index in sorted(entries):
        entry, param = dict(entries[index]), params[index]
        split = _split_of(param)
        for key, value in sorted(entry.items()):
            if split is not None and isinstance(value, torch.Tensor) and value.shape == param.shape:
                entry[key] = gather_shards(value, *split, group)
        out[index] = entry
    return out


def _shard(entries: dict, params: list, state) -> dict:
    """The inverse of :func:`_unshard` for this TP rank: full-shape tensors of split
    parameters cut to this rank's shard."""
    if state.axis_size("tp") == 1:
        return entries
    from smp.core.shards import shard_tensor

    n, r = state.axis_size("tp"), state.axis_rank("tp")
    out = {}
    for index, entry in entries.items():
        param, entry = params[int(index)], dict(entry)
        split = _split_of(param)
        for key, value in entry.items():
            if split is None or not isinstance(value, torch.Tensor) or value.dim() <= split[0]:
                continue
            if value.size(split[0]) == param.size(split[0]) * n:
                entry[key] = shard_tensor(value, split[0], split[1], n, r)
        out[index] = entry
    return out

"""``smp.DistributedOptimizer``: the user's torch optimizer, with smp's methods (api.md §4).

As in SMP v1, ``smp.DistributedOptimizer(optimizer)`` returns ``optimizer`` itself, its class
swapped for a subclass of both its own class and :class:`DistributedOptimizer`: it stays a
``torch.optim.Optimizer`` (and an ``AdamW``, ...), so LR schedulers and any code that checks the
type take it. Gradients reaching ``step()`` are already reduced by ``smp.step``; the overrides
add ``clip_grad_norm_`` over the global gradient norm and make ``state_dict()`` the full state
(gathered over the pipeline and tensor-parallel groups) with ``local_state_dict()`` this rank's.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from smp.model import PARTIAL_KEY
from smp.state import get_state

__all__ = ["DistributedOptimizer"]

logger = logging.getLogger("smp")

_classes: dict[type, type] = {}
SCALER_KEY = "smp_loss_scaler"  # the fp16 loss scale's state, in the optimizer's state dicts
MASTER_KEY = "smp_master"  # a float32 master weight, in its parameter's state-dict entry


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
        optimizer._smp_synced = False  # this step's gradients copied to the master weights
        optimizer._smp_scaler = None
        optimizer._smp_unscaled = None  # this step's overflow, once unscaled (clip_grad_norm_)
        if state.config.fp16:
            optimizer._smp_scaler = LossScaler(static_loss_scale, dynamic_loss_scale, args)
            state.loss_scale = optimizer._smp_scaler.scale
        state.optimizers.append(optimizer)
        return optimizer

    def __init__(self, optimizer: torch.optim.Optimizer | None = None, *args: Any, **kwargs: Any):
        pass  # the optimizer is built already: __new__ returned it as it is

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer itself (smp's earlier wrapper exposed it here)."""
        return self

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
        self._sync_master_grads()
        self._smp_synced = False
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

    # ---- float32 master weights of a low-precision model ------------------------------------

    def _step_and_copy_back(self, closure):
        result = super().step(closure)
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
        if not masters or self._smp_synced:
            return
        for master, param in masters.values():
            master.grad = None if param.grad is None else param.grad.detach().float()
        self._smp_synced = True

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
                    master.copy_(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._smp_synced = False
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
        master weights of a low-precision model are their parameters' ``MASTER_KEY`` entries."""
        packed = self._with_masters(super().state_dict())
        return {**packed, **self._scaler_state(), PARTIAL_KEY: True}

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
        the pipeline and tensor-parallel groups: every rank must call it."""
        local = self._with_masters(super().state_dict())
        state = get_state()
        params = [p for group in self.param_groups for p in group["params"]]
        entries = _unshard(local["state"], params, state)
        if state.axis_size("pp") > 1:
            entries = {i: {k: _cpu(v) for k, v in e.items()} for i, e in entries.items()}
            parts: list[Any] = [None] * state.axis_size("pp")
            dist.all_gather_object(parts, entries, group=state.groups["pp"])
            entries = {i: e for part in parts for i, e in part.items()}
        return {
            "state": dict(sorted(entries.items())),
            "param_groups": local["param_groups"],
            **self._scaler_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a full state (from :meth:`state_dict`, or one process's optimizer over the
        same model): each rank takes its stage's entries and its tensor-parallel shards. A
        partial state (from :meth:`local_state_dict`) is this rank's own: it loads as it is."""
        self._load_scaler_state(state_dict)
        if state_dict.get(PARTIAL_KEY, False):
            local = {k: v for k, v in state_dict.items() if k not in (PARTIAL_KEY, SCALER_KEY)}
            local["state"] = self._load_masters(local["state"])
            return super().load_state_dict(local)
        state = get_state()
        params = [p for group in self.param_groups for p in group["params"]]
        owned = {i for i, p in enumerate(params) if p.numel() > 0}
        entries = {i: e for i, e in state_dict["state"].items() if int(i) in owned}
        entries = self._load_masters(_shard(entries, params, state))
        super().load_state_dict({"state": entries, "param_groups": state_dict["param_groups"]})

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
        if math.isinf(norm_type):
            local = max((g.detach().abs().max() for g in grads), default=torch.zeros(()))
            total = local.to(device=device, dtype=torch.float32).reshape(1)
            if state.axis_size("mp") > 1:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=state.groups["mp"])
            norm = total[0]
        else:
            powers = [g.detach().float().norm(norm_type) ** norm_type for g in grads]
            total = torch.stack(powers).sum() if powers else torch.zeros((), device=device)
            total = total.reshape(1)
            if state.axis_size("mp") > 1:
                dist.all_reduce(total, group=state.groups["mp"])
            norm = total[0] ** (1.0 / norm_type)
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1:
            for g in all_grads:
                g.detach().mul_(coefficient.to(g.dtype))
        return norm


_LOW_PRECISION = (torch.float16, torch.bfloat16)


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


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _split_of(param: torch.Tensor) -> tuple[int, int] | None:
    return getattr(param, "_smp_tp_split", None)


def _unshard(entries: dict, params: list, state) -> dict:
    """Optimizer state with each tensor shaped like a TP-split parameter's shard joined to the
    full shape (an all-gather over the TP group per tensor, in index order on every TP rank)."""
    if state.axis_size("tp") == 1:
        return entries
    from smp.nn.functional import gather_shards

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
    from smp.nn.functional import shard_tensor

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

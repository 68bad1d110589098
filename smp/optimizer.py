"""``smp.DistributedOptimizer``: the user's torch optimizer, with smp's methods (api.md §4).

As in SMP v1, ``smp.DistributedOptimizer(optimizer)`` returns ``optimizer`` itself, its class
swapped for a subclass of both its own class and :class:`DistributedOptimizer`: it stays a
``torch.optim.Optimizer`` (and an ``AdamW``, ...), so LR schedulers and any code that checks the
type take it. Gradients reaching ``step()`` are already reduced by ``smp.step``; the overrides
add ``clip_grad_norm_`` over the global gradient norm and make ``state_dict()`` the full state
(gathered over the pipeline and tensor-parallel groups) with ``local_state_dict()`` this rank's.

With ``shard_optimizer_state`` (ZeRO-1) every parameter of a stage belongs to one rank of the
group holding the same parameters (rdp): only its owner keeps its optimizer state and updates
it, then broadcasts the new values to the group (:mod:`smp.dp.optimizer_state`, which also
gathers the full state dict and cuts each rank's part from it).
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

import torch
import torch.distributed as dist

from smp import amp
from smp.checkpoints.keys import MASTER_KEY, PARTIAL_KEY, SCALER_KEY, SHARD_KEY
from smp.dp import optimizer_state, sharded
from smp.state import get_state

__all__ = ["DistributedOptimizer"]

logger = logging.getLogger("smp")

_classes: dict[type, type] = {}


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
            v1 (:class:`smp.amp.LossScaler`; the dynamic arguments may also come as keywords);
            unused while ``fp16`` is off, as in v1. With ``fp16`` on, ``model.backward`` scales
            the loss and ``step()`` unscales, skipping the step on every rank when any rank's
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
            optimizer._smp_scaler = amp.LossScaler(static_loss_scale, dynamic_loss_scale, args)
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
        return optimizer_state.parameters(self)

    def _shard_owners(self) -> list[int | None] | None:
        """With ``shard_optimizer_state`` over more than one rdp rank: the rdp rank that owns
        each optimizer parameter (by index; None for another stage's), else None."""
        return optimizer_state.owners(self)

    def _state_kept(self) -> set[int] | None:
        """The ids of the parameters whose optimizer state this rank keeps and updates: None
        (all of them) without ``shard_optimizer_state``, else those it owns."""
        owners = self._shard_owners()
        if owners is None:
            return None
        params = self._params()
        return {id(params[i]) for i in optimizer_state.owned_indices(owners)}

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
            model = self._model()
            cap = None if model is None else model.bucket_bytes
            result = optimizer_state.step_owned(self, owners, self._algorithm_step, closure, cap)
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
        owned = optimizer_state.owned_indices(owners)
        return {
            **packed,
            "state": optimizer_state.only(packed["state"], owned),
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
        params = self._params()
        for index, p in enumerate(params):
            if id(p) in masters and p.numel() > 0:
                entries[index] = {**entries.get(index, {}), MASTER_KEY: p.detach()}
        return {**packed, "state": entries}

    def _load_masters(self, entries: dict) -> dict:
        """Copies ``MASTER_KEY`` entries into the master weights; the entries without them."""
        params = self._params()
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
        entries = optimizer_state.gather_full(local["state"], self._params(), self._shard_owners())
        return {
            "state": entries,
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
            # Before the partition the owners are not decided: the first step checks nothing.
            if self._partitioned():
                optimizer_state.check_partial(state_dict.get(SHARD_KEY), owners)
            self._load_scaler_state(state_dict)
            drop = (PARTIAL_KEY, SCALER_KEY, SHARD_KEY)
            local = {k: v for k, v in state_dict.items() if k not in drop}
            local["state"] = self._load_masters(local["state"])
            return super().load_state_dict(local)
        self._load_scaler_state(state_dict)
        entries = optimizer_state.take_local(state_dict["state"], self._params())
        entries = self._load_masters(entries)
        if owners is not None and self._partitioned():
            # Before a partition the owners are not final: the first step drops the others.
            entries = optimizer_state.only(entries, optimizer_state.owned_indices(owners))
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

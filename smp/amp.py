"""smp.amp (SMP v1): a gradient scaler for scripts that scale fp16 losses themselves.

``smp.amp.GradScaler`` is ``torch.amp.GradScaler`` whose overflow check covers every rank: each
rank's inf/NaN flags are all-reduced (MAX) over the world when the gradients are unscaled, so a
step is skipped, and the scale lowered, on every rank at once (pipeline stages and TP shards
hold different gradients). Use it as torch's: ``model.backward(scaler.scale(loss))`` inside the
step function, then (optionally ``scaler.unscale_(optimizer)`` and
``optimizer.clip_grad_norm_(max_norm)``) ``scaler.step(optimizer)`` and ``scaler.update()``
after it. (With ``smp.DistributedOptimizer``'s own loss scaling under ``"fp16": True`` there is
nothing to add.)

A float16 / bfloat16 model's optimizer steps float32 master weights (design.md §8), which get
the model's gradients only when asked: ``unscale_`` first copies them in (so torch's unscaling
and inf check see this step's gradients, not the masters' empty ones), then unscales the
masters' gradients.

:class:`LossScaler` is the loss scale of ``smp.DistributedOptimizer``'s own fp16 loss scaling
(SMP v1's ``static_loss_scale`` / ``dynamic_loss_scale`` arguments).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from smp.state import get_state, is_initialized

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with the overflow decision agreed by every rank. ``device``
    defaults to this rank's device type (v1 takes no device)."""

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ):
        if device is None:
            device = get_state().device.type if is_initialized() else "cpu"
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )
        if self._enabled:
            # Now, not at the first scale(): under pipeline parallelism only the stage that runs
            # the step function calls scale(), and every stage unscales and steps.
            self._lazy_init_scale_growth_tracker(torch.device(device))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        sync = getattr(optimizer, "_sync_master_grads", None)
        if self._enabled and sync is not None:
            # A low-precision model's float32 masters are the optimizer's parameters: they get
            # this step's (still scaled) gradients now, else torch unscales and checks nothing
            # and the step applies scaled gradients (design.md §8).
            sync()
        super().unscale_(optimizer)
        if not self._enabled or not is_initialized():
            return
        state = get_state()
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = torch.zeros(1, dtype=torch.float32, device=state.device)
        for flag in found.values():
            local = torch.maximum(local, flag.reshape(1).to(local.device, torch.float32))
        if state.world_size > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=state.groups["world"])
        for flag in found.values():
            flag.copy_(local.to(flag.device).reshape(flag.shape))
        if not found:  # this rank holds no gradient: it still follows the others' decision
            found[state.device] = local.reshape(())

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """torch's ``step``, with this scaler's unscaling (the masters' gradients, the agreed
        inf check) also before an optimizer that unscales in its own step (``fused=True``:
        torch would otherwise check only this rank's gradients), and the masters' gradients
        taken afresh next step whether or not this one was skipped."""
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        stage = self._per_optimizer_states[id(optimizer)]["stage"]
        if self._enabled and fused and stage is OptState.READY:
            self.unscale_(optimizer)
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            if hasattr(optimizer, "_smp_copied_grads"):
                # A skipped step never reaches optimizer.step(), which would have cleared it.
                optimizer._smp_copied_grads = None


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

"""``smp.DistributedOptimizer``: wraps a torch optimizer built from ``model.parameters()``
(api.md §4).

Gradients reaching ``step()`` are already reduced by ``smp.step``; this wrapper keeps the torch
optimizer's interface and adds ``clip_grad_norm_`` over the global gradient norm.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from smp.state import get_state

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer:
    """Wraps ``optimizer`` for smp.

    Args:
        optimizer: a torch.optim.Optimizer over the DistributedModel's parameters.
        static_loss_scale: loss scale for fp16 training (1.0: off).
        dynamic_loss_scale: adapt the loss scale for fp16 training.

    Raises:
        ValueError: ``optimizer`` is not a torch optimizer.
        NotImplementedError: loss scaling, which arrives with fp16 support.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        **dynamic_loss_args: Any,
    ):
        get_state()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "smp.DistributedOptimizer wraps a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        if static_loss_scale != 1.0 or dynamic_loss_scale or dynamic_loss_args:
            raise NotImplementedError(
                "smp.DistributedOptimizer: loss scaling (static_loss_scale != 1.0, "
                "dynamic_loss_scale) comes with fp16 support, which this version does not have"
            )
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        """One optimizer step on the reduced gradients (call it outside the step function)."""
        if get_state().in_step:
            raise RuntimeError(
                "optimizer.step() must be called after the @smp.step function returns, not "
                "inside it"
            )
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state (the local one equals it while pp = tp = 1)."""
        return self.optimizer.state_dict()

    def local_state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scales every gradient so the global ``norm_type`` norm is at most ``max_norm``.

        The norm is taken over the gradients of all ranks of the model replica (the mp group);
        data-parallel replicas hold identical reduced gradients and are not counted twice.

        Returns:
            The global norm before clipping.
        """
        if not max_norm > 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm!r}")
        state = get_state()
        grads = [
            p.grad for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        grads = all_grads = list({id(g): g for g in grads}.values())
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

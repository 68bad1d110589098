"""What a rank holds, under checkpoint keys: the model's tensors (``model/<key>``) and the
optimizer's state (``optim/<parameter key>/<state key>``, the hyperparameters and the loss
scale), each tensor-parallel shard described as the chunk(s) of the full tensor it is, and the
optimizer state a fresh optimizer must have before DCP can load into it."""

from __future__ import annotations

from typing import Any

import torch

from smp.checkpoints.integrity import CheckpointError
from smp.checkpoints.keys import MASTER_KEY
from smp.dp import sharded

__all__ = [
    "model_entries",
    "optimizer_entries",
    "owned_optimizer_params",
    "stateful_params",
    "materialize_optimizer_state",
]


def _tp(state) -> tuple[int, int]:
    return state.axis_size("tp"), state.axis_rank("tp")


def _entry(value: Any, param: torch.Tensor | None, state) -> Any:
    """``value`` as DCP sees it: the chunks of the full tensor when it is a TP shard shaped
    like its split parameter ``param`` or a sharded data parallel chunk, else itself."""
    from smp.checkpoints.dcp import _Chunks

    split = getattr(param, "_smp_tp_split", None)
    if sharded.is_sharded(value):  # a sharded data parallel chunk (of a TP shard)
        local, row = sharded.chunk_box(value)
        tp = split is not None and value.shape == param.shape and _tp(state)[0] > 1
        return _Chunks.of_rows(local, row, value.shape, split if tp else None, *_tp(state))
    if (
        split is not None
        and isinstance(value, torch.Tensor)
        and value.shape == param.shape
        and _tp(state)[0] > 1
    ):
        return _Chunks.of(value, split, *_tp(state))
    return value


def model_entries(model, state) -> dict[str, Any]:
    split = model._split_params()
    return {f"model/{k}": _entry(v, split.get(k), state) for k, v in model._local_state().items()}


def _param_names(model) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.module.named_parameters():
        names.setdefault(id(p), name)
    return names


def owned_optimizer_params(model, optimizer) -> list[tuple[str, torch.Tensor]]:
    """(model parameter name, optimizer parameter) for this rank's parameters; an optimizer
    parameter may be the float32 master weight of a low-precision model parameter."""
    names = _param_names(model)
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(optimizer.model_parameter(p)))
            if name is None:
                raise CheckpointError(
                    "the optimizer holds a parameter that is not one of the model's (shape "
                    f"{tuple(p.shape)}): a checkpoint names optimizer state by parameter name; "
                    "build the optimizer over model.parameters()"
                )
            if model._owns(name):
                out.append((name, p))
    return out


def stateful_params(model, optimizer) -> list[tuple[str, torch.Tensor]]:
    """Those of :func:`owned_optimizer_params` whose optimizer state this rank keeps: all of
    them, except under ``shard_optimizer_state``, where each belongs to one rdp rank."""
    kept = optimizer._state_kept()
    owned = owned_optimizer_params(model, optimizer)
    return owned if kept is None else [(n, p) for n, p in owned if id(p) in kept]


def optimizer_entries(model, optimizer, state) -> dict[str, Any]:
    """This rank's optimizer state under checkpoint keys: its parameters' (under
    ``shard_optimizer_state``, those it owns: each rank writes and loads its shard, and the
    names are the same whichever rank holds them), the hyperparameters and the loss scale."""
    entries: dict[str, Any] = {}
    for name, p in stateful_params(model, optimizer):
        for key, value in optimizer.state.get(p, {}).items():
            entries[f"optim/{name}/{key}"] = _entry(value, p, state)
        if p is not optimizer.model_parameter(p):  # a float32 master weight
            entries[f"optim/{name}/{MASTER_KEY}"] = _entry(p.detach(), p, state)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    entries["optim/param_groups"] = groups
    scaler = getattr(optimizer, "_smp_scaler", None)
    if scaler is not None:
        entries["optim/loss_scaler"] = scaler.state_dict()
    return entries


def materialize_optimizer_state(model, optimizer) -> None:
    """Creates the optimizer's state for this rank's parameters if it has none yet (a fresh
    optimizer, before its first step), so that DCP has tensors to load into: one step of the
    optimizer's own algorithm on zero gradients with every learning rate at 0 (the parameters
    do not change). Under ``shard_optimizer_state`` only for the parameters this rank owns
    (the others have no gradient in that step, so they get no state)."""
    owned = [p for _, p in stateful_params(model, optimizer) if p.requires_grad]
    if all(optimizer.state.get(p) for p in owned):
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    rates = [g["lr"] for g in optimizer.param_groups]
    owned_ids = {id(p) for p in owned}
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in owned_ids else None
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        with torch.no_grad():
            before = [p.detach().clone() for p in owned]
            optimizer._algorithm_step()  # the user's class's own step
            for p, b in zip(owned, before):
                p.copy_(b)  # bit-exact, whatever the algorithm does at lr 0
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        for g, lr in zip(optimizer.param_groups, rates):
            g["lr"] = lr

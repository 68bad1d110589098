"""The state dicts of a ``DistributedModel`` (api.md §3): full, partial, and loading them.

A full state dict has the original keys and shapes, as one process holding the whole model
would save it: pipeline stages contribute their parts (a collective over the pipeline group),
tensor-parallel shards are gathered whole (a collective over the TP group), sharded data
parallel chunks are gathered too. A partial one (``local_state_dict()``, SMP v1's marker
``"_smp_is_partial": True``) is what this rank holds, as it holds it, and loads back only on the
layout that saved it.

The functions take the model duck-typed (this layer is below it): its ``module``, ``_owns``
(whether a name lives on this rank), ``_runtime`` (the pipeline runtime, or None),
``_sharded_units``, ``partitioned``, ``_deferred_load`` and ``_refresh_masters``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp.checkpoints.keys import PARTIAL_KEY
from smp.core.errors import StepFailedError
from smp.core.shards import gather_shards, shard_state
from smp.dp import sharded
from smp.dp.replicas import is_tp_shard
from smp.state import get_state

__all__ = [
    "full",
    "load",
    "load_deferred",
    "load_partial",
    "local",
    "local_state",
    "refresh_masters",
    "shard_tp",
    "split_params",
    "unshard_tp",
]


def local_state(model, *args, **kwargs) -> dict[str, Any]:
    """The entries of the wrapped module's state dict that this rank holds, as it holds them."""
    whole = model.module.state_dict(*args, **kwargs)
    return {k: v for k, v in whole.items() if model._owns(k)}


def local(model, *args, **kwargs) -> dict[str, Any]:
    """``local_state`` with v1's marker of a partial state dict."""
    return {**local_state(model, *args, **kwargs), PARTIAL_KEY: True}


def full(model, *args, **kwargs) -> dict[str, Any]:
    """The full model's state dict with the original keys and shapes (a collective over the
    pipeline group with pipeline parallelism, over the TP group with TP shards)."""
    module = model.module
    if model._runtime is None:
        whole = module.state_dict(*args, **kwargs)
        if model._sharded_units:  # whole tensors, in key order on every rank
            whole = type(whole)((k, sharded.full(v)) for k, v in whole.items())
        return unshard_tp(module, whole)
    state = get_state()
    mine = unshard_tp(module, local_state(model))  # full shapes, this stage's keys
    mine = {k: v.detach().cpu() for k, v in mine.items()}
    parts: list[Any] = [None] * state.axis_size("pp")
    dist.all_gather_object(parts, mine, group=state.groups["pp"])
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    order = list(module.state_dict().keys())
    return {k: merged[k] for k in order if k in merged}


def load(model, state_dict, strict: bool, assign: bool):
    """``model.load_state_dict``: a full state dict (each rank takes the part it holds), or a
    partial one (loaded on this rank; before the partition kept for right after it)."""
    if state_dict.get(PARTIAL_KEY, False):
        if not model.partitioned:  # v1: it loads once this rank knows its part
            model._deferred_load = (state_dict, strict, assign)
            return None
        return load_partial(model, state_dict, strict, assign)
    state_dict = {k: v for k, v in state_dict.items() if k != PARTIAL_KEY}
    module = model.module
    if model._runtime is None:
        mine = shard_tp(module, state_dict)
        if model._sharded_units:  # this rank's chunk of each sharded parameter
            current = module.state_dict()
            mine = {k: sharded.like(v, current[k]) if k in current else v for k, v in mine.items()}
        result = module.load_state_dict(mine, strict=strict, assign=assign)
        model._refresh_masters()
        return result
    mine = shard_tp(module, {k: v for k, v in state_dict.items() if model._owns(k)})
    expected = set(local_state(model))
    if strict:
        missing = sorted(expected - set(mine))
        unknown = sorted(k for k in state_dict if k not in module.state_dict())
        if missing or unknown:
            raise ValueError(
                f"load_state_dict: missing keys {missing[:5]}, unexpected keys {unknown[:5]}"
            )
    result = module.load_state_dict(mine, strict=False, assign=assign)
    model._refresh_masters()
    return result


def load_partial(model, state_dict, strict: bool, assign: bool):
    """Loads this rank's partial state dict, which must match what this rank holds."""
    mine = {k: v for k, v in state_dict.items() if k != PARTIAL_KEY}
    held = local_state(model)
    missing = sorted(set(held) - set(mine))
    unexpected = sorted(set(mine) - set(held))
    wrong = [
        f"{k} {tuple(v.shape)} (this rank holds {tuple(held[k].shape)})"
        for k, v in mine.items()
        if k in held and isinstance(v, torch.Tensor) and v.shape != held[k].shape
    ]
    if wrong or (strict and (missing or unexpected)):
        raise ValueError(
            "load_state_dict: a partial state dict (_smp_is_partial) loads on the rank and "
            "layout that saved it; this one does not match this rank: "
            f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}, other shapes "
            f"{wrong[:5]}. Save state_dict() (full) to load on another layout."
        )
    result = model.module.load_state_dict(mine, strict=False, assign=assign)
    model._refresh_masters()
    return result


def load_deferred(model) -> None:
    """Loads a partial state dict given before the partition; every rank learns whether
    every rank could (one small all-gather), so a mismatch fails everywhere at once."""
    state = get_state()
    deferred, model._deferred_load = model._deferred_load, None
    failure: BaseException | None = None
    if deferred is not None:
        try:
            load_partial(model, *deferred)
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            failure = exc
    outcomes: list[Any] = [None] * state.world_size
    dist.all_gather_object(
        outcomes, None if failure is None else str(failure), group=state.groups["world"]
    )
    if failure is not None:
        raise failure
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if failed:
        rank, message = failed[0]
        raise StepFailedError(
            f"smp: loading the partial state dict given before the partition failed on rank "
            f"{rank}: {message}"
        )


def refresh_masters(param_ids: set[int]) -> None:
    """Float32 master weights follow the values of the model parameters (ids) ``param_ids``:
    after a state was loaded into them or they were given values (an optimizer's
    ``load_state_dict`` afterwards brings its own back)."""
    for optimizer in get_state().optimizers:
        optimizer._refresh_masters(param_ids)


def split_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """The TP-split parameters by name."""
    # Every name of a shared (tied) parameter: the state dict has a key for each.
    named = module.named_parameters(remove_duplicate=False)
    return {n: p for n, p in named if is_tp_shard(p)}


def unshard_tp(module: nn.Module, local: dict[str, Any]) -> dict[str, Any]:
    """Full shapes for the TP shards of a state dict (a collective over the TP group)."""
    split = split_params(module)
    if not split:
        return local
    group = get_state().groups["tp"]
    out = dict(local)
    for key in local:
        param = split.get(key)
        if param is not None:
            out[key] = gather_shards(local[key], *param._smp_tp_split, group)
    return out


def shard_tp(module: nn.Module, whole: dict[str, Any]) -> dict[str, Any]:
    """This rank's shards of the TP-split entries of a full state dict."""
    split = split_params(module)
    if not split:
        return whole
    state = get_state()
    n, r = state.axis_size("tp"), state.axis_rank("tp")
    for key, value in whole.items():
        param = split.get(key)
        if param is None:
            continue
        dim = param._smp_tp_split[0]
        if value.dim() <= dim or value.size(dim) != param.size(dim) * n:
            raise ValueError(
                f"load_state_dict: {key} has shape {tuple(value.shape)}; expected the full "
                f"shape, {param.size(dim) * n} along dim {dim} (this rank holds "
                f"{tuple(param.shape)} of it, tensor_parallel_degree {n})"
            )
    return shard_state(whole, split, n, r)

"""Sharded data parallelism (``sharded_data_parallel_degree``, design.md §7.5) on FSDP2.

Each rdp group (the data-parallel ranks that hold the same parameters: the same stage and the
same tensor-parallel slice) splits into sharding groups of ``sharded_data_parallel_degree``
consecutive ranks. ``fully_shard`` runs over a mesh of those groups (a 2-D mesh, replicate x
shard, when the sharding groups replicate one another): every parameter becomes a DTensor
holding this rank's dim-0 chunk, gathered for a block's forward and backward and freed after,
and its gradient is reduce-scattered as soon as the block's backward is done. A tensor-parallel
shard is a plain local tensor to FSDP2, so it is sharded again over the rdp ranks.

FSDP2 sums; smp divides. Gradients come out of FSDP2 summed over the rdp group (reduce-scatter
over the sharding group, all-reduce over its replicas); at the end of a step smp adds the
tensor-parallel ranks' shares of gradients reduced over the whole dp group and divides by the
same divisor as without sharding (:func:`smp.dp.grads.group_and_divisor`), so both paths
compute the same mean.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp.state import get_state

# smp's tags on a parameter; fully_shard makes new Parameter objects, which get them back.
_TAGS = ("_smp_tp_split", "_smp_tp_reduce", "_smp_remote")


def enabled() -> bool:
    return get_state().config.sharded_data_parallel_degree > 1


def mesh():
    """This rank's sharding mesh: 1-D over its sharding group, or 2-D (replicate, shard) when
    its rdp group holds several sharding groups. Built once per ``smp.init``."""
    state = get_state()
    cached = getattr(state, "_sdp_mesh", None)
    if cached is not None:
        return cached
    from torch.distributed.device_mesh import DeviceMesh

    device_type = torch.device(state.device).type
    shard = state.group_ranks["sdp"]
    replicate = state.group_ranks["sdp_replicate"]
    # Named after this init's group: DTensor caches sharding decisions keyed by meshes that
    # compare equal by layout and names alone, so a mesh equal to one of an earlier smp.init
    # would be handed back with that init's (destroyed) process groups.
    name = f"sdp_{state.groups['sdp'].group_name}"
    if len(replicate) == 1:
        result = DeviceMesh.from_group(state.groups["sdp"], device_type, mesh_dim_names=(name,))
    else:
        rdp = sorted(state.group_ranks["rdp"])
        layout = torch.tensor(rdp).reshape(len(replicate), len(shard))
        result = DeviceMesh.from_group(
            [state.groups["sdp_replicate"], state.groups["sdp"]],
            device_type,
            mesh=layout,
            mesh_dim_names=(f"{name}_replicate", name),
        )
    state._sdp_mesh = result
    return result


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 gathers one at a time: the elements of the outermost layer lists
    (``nn.ModuleList`` / ``nn.Sequential``) that hold parameters, each once, except one that
    shares a parameter with a module outside it (tied weights stay with the root)."""
    found: list[nn.Module] = []
    seen: set[int] = set()

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                for element in child:
                    if id(element) not in seen and any(True for _ in element.parameters()):
                        seen.add(id(element))
                        found.append(element)
            else:
                walk(child)

    walk(module)

    def uses(m: nn.Module) -> collections.Counter:
        return collections.Counter(id(p) for _, p in m.named_parameters(remove_duplicate=False))

    everywhere = uses(module)
    return [b for b in found if all(everywhere[i] == n for i, n in uses(b).items())]


def shard_module(module: nn.Module, before=None) -> list[nn.Module]:
    """``fully_shard`` over :func:`mesh`: each block of :func:`_blocks`, then ``module`` (the
    rest); smp's parameter tags carried over to the sharded parameters. ``before(unit)``, when
    given, runs just before each is sharded (delayed initialisation gives the unit's parameters
    their values there). Returns the sharded modules, the root last."""
    from torch.distributed.fsdp import fully_shard

    tags = {
        name: {tag: getattr(p, tag) for tag in _TAGS if hasattr(p, tag)}
        for name, p in module.named_parameters(remove_duplicate=False)
    }
    the_mesh = mesh()
    units = _blocks(module) + [module]
    for unit in units:
        if before is not None:
            before(unit)
        unit.register_forward_hook(_own_outputs)  # runs before FSDP2's own (registered next)
        fully_shard(unit, mesh=the_mesh, reshard_after_forward=True)
        unit.set_gradient_divide_factor(1.0)  # a sum: smp divides (module docstring)
        if hasattr(unit, "set_force_sum_reduction_for_comms"):
            unit.set_force_sum_reduction_for_comms(True)
    for name, p in module.named_parameters(remove_duplicate=False):
        for tag, value in tags[name].items():
            setattr(p, tag, value)
    return units


def _own_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """A unit's output tensors that are views (a tensor-parallel block's chunk of its group's
    batch) as tensors of their own: FSDP2 hooks them for the unit's backward, and an in-place
    op on a view would drop that hook."""
    from smp.core import tree

    return tree.map_tensors(lambda t: t.clone() if t._is_view() else t, output)


def is_sharded(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full(value: Any) -> Any:
    """A DTensor gathered to its whole (a collective over its mesh); anything else as it is."""
    return value.full_tensor() if is_sharded(value) else value


def like(value: Any, param: torch.Tensor) -> Any:
    """``value``, a whole tensor shaped like the sharded ``param``, cut to this rank's chunk as
    a DTensor placed as ``param`` is (no communication); anything else as it is."""
    if not is_sharded(param) or is_sharded(value) or not isinstance(value, torch.Tensor):
        return value
    if value.shape != param.shape:
        return value
    from torch.distributed.tensor import distribute_tensor

    value = value.to(device=param.device)
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)


def chunk_box(value: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's local tensor, its first row) of a DTensor sharded on dim 0 (rows of the
    tensor it is a chunk of)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return value.to_local(), int(offset[0]) if value.dim() else 0


def finish_grads(params: list[torch.Tensor], reduction, num_mb: int, bucket_bytes: int) -> None:
    """The end of a step's gradient reduction for sharded parameters: FSDP2 summed each over
    the rdp group; one reduced over the dp group also sums over the TP group (its local chunks
    line up: every TP rank shards it the same way); then each is divided as smp divides.
    ``reduction(p)`` is :func:`smp.dp.grads.group_and_divisor`; the TP sum runs in buckets of
    ``bucket_bytes``."""
    state = get_state()
    tp_sum: list[torch.Tensor] = []
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            group, divisor = reduction(p)
            local = p.grad.to_local()
            if group == "dp" and state.axis_size("tp") > 1:
                tp_sum.append(local)
            local.div_(float(divisor * num_mb))
        if tp_sum:
            from smp import _C

            _C.allreduce_mean_(tp_sum, state.groups["tp"], 1.0, bucket_bytes)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of a sharded tensor (a gradient, a state tensor); others as they are."""
    return t.to_local() if is_sharded(t) else t


def sum_over_shards(total: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
    """Adds (or ``op``) ``total`` over this rank's sharding group, in place."""
    state = get_state()
    if enabled():
        dist.all_reduce(total, op=op, group=state.groups["sdp"])

"""Where a partitioned model's tensors live (design.md §4.8).

After the partition each rank keeps only the parameters and buffers of its own pipeline stage:
those of the other stages are released (empty tensors, the same objects), its own move to its
device. The tensor objects always stay (optimizers hold them); only their values move. ``owns``
is the model's rule "this name lives on this rank" (original keys).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp.state import get_state

__all__ = ["gather_stages", "place_owned", "release_remote", "tracing_device"]


def place_owned(
    module: nn.Module, owns: Callable[[str], bool], move: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Replaces the values of the parameters and buffers of ``module`` whose names ``owns``
    accepts by ``move(value)`` in place (``.data``: the tensor objects stay), gradients with
    them; shared tensors once, under their first name."""
    with torch.no_grad():
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            if not owns(name):
                continue
            tensor.data = move(tensor.data)
            if tensor.grad is not None:
                tensor.grad = move(tensor.grad)


def release_remote(module: nn.Module, owns: Callable[[str], bool]) -> None:
    """Frees the storage of parameters and buffers owned by other stages: each rank keeps
    only its modules' tensors (``state_dict()`` gathers them from their owners)."""
    with torch.no_grad():
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            if not owns(name):
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    for optimizer in get_state().optimizers:  # float32 master weights of released ones
        optimizer._release_masters()


def gather_stages(module: nn.Module, owns: Callable[[str], bool]) -> None:
    """Gives the parameters and buffers of every pipeline stage their values on this rank, on
    the CPU (a collective over the pipeline group). A pipeline group's ranks share a TP rank:
    each stage's tensors (its shards as they are, non-persistent buffers included) are what
    this rank needs."""
    tensors = dict((*module.named_parameters(), *module.named_buffers()))
    own = {n: t.detach().cpu() for n, t in tensors.items() if owns(n)}
    state = get_state()
    parts: list[Any] = [None] * state.axis_size("pp")
    dist.all_gather_object(parts, own, group=state.groups["pp"])
    with torch.no_grad():
        for part in parts:
            for name, value in part.items():
                if not owns(name):
                    tensors[name].data = value.to(tensors[name].dtype)


def tracing_device(trace_device: str) -> torch.device:
    """Where rank 0 traces the model (pp > 1): this rank's device with ``trace_device="gpu"``
    (v1's meaning: the whole model must fit one GPU), else the CPU."""
    return get_state().device if trace_device == "gpu" else torch.device("cpu")

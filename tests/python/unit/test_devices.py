"""Where things live (design.md §4.8): each rank's device from the configuration, and a
pipelined model's parameters moved by ownership after the partition (the meta device stands
in for a GPU: what moves there loses its values, what stays keeps them)."""

from __future__ import annotations

import torch
from torch import nn

from smp.partitioning.placement import place_owned
from smp.state import _resolve_backend, _resolve_device
from smp.step import _from_host, _to_host


def test_the_device_follows_backend_and_local_rank():
    assert _resolve_device("auto", "gloo", 3) == torch.device("cpu")
    assert _resolve_device("cpu", "gloo", 3) == torch.device("cpu")
    assert _resolve_device("auto", "nccl", 3) == torch.device("cuda", 3)
    assert _resolve_device("cuda", "nccl", 1) == torch.device("cuda", 1)
    assert _resolve_backend("auto", "cpu") == "gloo"  # whether or not CUDA is there
    assert _resolve_backend("gloo", "cuda") == "gloo"
    # "auto" follows a default group initialised already (e.g. torchrun scripts, test pools).
    assert _resolve_backend("auto", "auto", "gloo") == "gloo"
    assert _resolve_backend("auto", "auto", "nccl") == "nccl"
    assert _resolve_backend("auto", "cpu", "nccl") == "gloo"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.BatchNorm1d(3)
        self.c = nn.Linear(3, 3)
        self.c.weight = self.a.weight  # shared: placed by its first name, as partitioning does


def test_only_the_owned_tensors_move_and_keep_their_identity():
    net = Net()
    net.a.bias.grad = torch.ones(3)
    objects = {name: t for name, t in (*net.named_parameters(), *net.named_buffers())}
    before = {name: t.detach().clone() for name, t in objects.items()}
    mine = ("a.", "b.running_mean")
    # float64 stands in for a device: what moves changes, what stays does not.
    place_owned(net, lambda name: name.startswith(mine), lambda t: t.double())
    after = dict((*net.named_parameters(), *net.named_buffers()))
    assert all(after[name] is t for name, t in objects.items())  # optimizers hold these
    for name, t in after.items():
        moved = name.startswith(mine) and t.is_floating_point()
        assert (t.dtype == torch.float64) == moved, name
        assert torch.equal(t, before[name].to(t.dtype)), name
    assert net.b.num_batches_tracked.dtype == torch.int64  # not owned: as it was
    assert net.a.bias.grad.dtype == torch.float64
    assert net.c.weight.dtype == torch.float64  # the shared weight went with its owner "a"


def test_step_results_keep_their_device_and_grad_flag_through_the_host():
    host = torch.ones(2, requires_grad=True)
    assert _to_host(host) is host  # CPU tensors travel as they are
    assert _from_host(host, torch.device("meta")) is host
    marked = torch.ones(2)
    marked._smp_on_device = True  # what _to_host sets on a device tensor's host copy
    assert _from_host(marked, torch.device("meta")).device.type == "meta"

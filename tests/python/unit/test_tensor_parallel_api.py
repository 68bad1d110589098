"""Single-process checks of the tensor-parallel API: marking, registration errors, shard math."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import smp
from smp.partitioning.trace import _PIN_ATTR
from smp.tp.functional import shard_tensor, unshard_tensor
from smp.tp.registry import _MARK


def test_context_marks_modules_and_nests_with_partition():
    with smp.tensor_parallelism(optimize="memory"):
        a = nn.Linear(2, 2)
        with smp.partition(1):
            b = nn.Linear(2, 2)
            with smp.tensor_parallelism(enabled=False):
                c = nn.Linear(2, 2)
        d = nn.Linear(2, 2)  # still marked after the inner contexts closed
    e = nn.Linear(2, 2)
    assert getattr(a, _MARK) == {"optimize": "memory"}
    assert getattr(b, _MARK) == {"optimize": "memory"} and getattr(b, _PIN_ATTR) == 1
    assert getattr(c, _MARK) is False and getattr(c, _PIN_ATTR) == 1
    assert getattr(d, _MARK) == {"optimize": "memory"} and not hasattr(d, _PIN_ATTR)
    assert not hasattr(e, _MARK)
    assert nn.Module.__init__ is smp.core.creation._original_init


def test_set_tensor_parallelism_marks_the_subtree():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    smp.set_tensor_parallelism(model)
    assert all(getattr(m, _MARK) == {} for m in model.modules())
    smp.set_tensor_parallelism(model[1], enabled=False)
    assert getattr(model[1][0], _MARK) is False
    with pytest.raises(ValueError, match="nn.Module"):
        smp.set_tensor_parallelism("not a module")


def test_model_creation_sets_and_restores_the_default_dtype():
    with smp.model_creation(dtype=torch.float64):
        layer = nn.Linear(2, 2)
    assert layer.weight.dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(ValueError, match="dtype"), smp.model_creation(dtype="float64"):
        pass


def test_registration_errors_name_the_problem():
    with pytest.raises(ValueError, match="not an nn.Module class"):
        smp.tp_register_with_module(int, nn.Linear)
    with pytest.raises(ValueError, match="init_hook must be callable"):
        smp.tp_register_with_module(nn.Identity, nn.Linear, init_hook=3)
    with pytest.raises(ValueError, match="both column and row"):
        smp.tp_register_plan(nn.Identity, column=["a"], row=["a"])
    with pytest.raises(ValueError, match="must be a column path"):
        smp.tp_register_plan(nn.Identity, column=["a"], row=["b"], fused={"b": 3})


@pytest.mark.parametrize("fused", [1, 3])
@pytest.mark.parametrize("dim", [0, 1])
def test_shard_and_unshard_are_inverse(fused, dim):
    full = torch.arange(12 * 6, dtype=torch.float32).view(12, 6)
    n = 2
    shards = [shard_tensor(full, dim, fused, n, r) for r in range(n)]
    assert all(s.size(dim) == full.size(dim) // n for s in shards)
    torch.testing.assert_close(unshard_tensor(shards, dim, fused), full)
    if fused == 3 and dim == 0:  # rank 0 holds the first half of each of the three blocks
        torch.testing.assert_close(shards[0][:2], full[:2])
        torch.testing.assert_close(shards[0][2:4], full[4:6])


def test_tp_degree_one_leaves_marked_modules_alone(single_process_smp):
    smp_ = single_process_smp()
    with smp_.tensor_parallelism():
        net = nn.Sequential(nn.Linear(4, 4))
    model = smp_.DistributedModel(net)
    assert model.distributed_modules == []
    assert type(model.module[0]) is nn.Linear

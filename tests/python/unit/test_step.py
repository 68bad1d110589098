"""smp.step in one process: splitting, StepOutput, evaluation steps and errors."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn


def test_api_before_init_says_to_call_init():
    import smp

    assert not smp.is_initialized()
    for call in (smp.rank, smp.dp_size, lambda: smp.DistributedModel(nn.Linear(2, 2))):
        with pytest.raises(RuntimeError, match=r"call smp.init"):
            call()


def test_bad_config_fails_before_anything_is_created(single_process_smp):
    import torch.distributed as dist

    with pytest.raises(ValueError, match="did you mean"):
        single_process_smp({"microbatch": 2})
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="fp16"):
        single_process_smp({"fp16": True, "bf16": True})
    assert not dist.is_initialized()


def test_single_process_world(single_process_smp):
    smp = single_process_smp({"microbatches": 2})
    assert (smp.rank(), smp.size(), smp.dp_size(), smp.pp_size(), smp.tp_size()) == (0, 1, 1, 1, 1)
    assert smp.allgather("x") == ["x"]
    smp.barrier()


class Recorder(nn.Module):
    """Returns its inputs' shapes so tests can see how smp split them."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.w


class Sliceable:
    def __init__(self, values):
        self.values = values

    def smp_slice(self, num_mb, mb, axis):
        n = len(self.values) // num_mb
        return Sliceable(self.values[mb * n : (mb + 1) * n])


def test_inputs_are_split_per_microbatch(single_process_smp):
    smp = single_process_smp({"microbatches": 4})
    model = smp.DistributedModel(Recorder())
    Pair = collections.namedtuple("Pair", "a b")
    seen = []

    @smp.step(non_split_inputs=["mask"], input_split_axes={"seq": 1})
    def f(model, x, nested, seq, mask, obj, scale, **extra):
        seen.append(
            (
                x.shape,
                nested["t"][0].shape,
                nested["t"][1],
                nested["p"].a.shape,
                nested["p"].b,
                seq.shape,
                mask.shape,
                obj.values,
                scale,
                extra["kw"].shape,
            )
        )
        return model(x).sum()

    out = f(
        model,
        torch.arange(8.0),
        {"t": [torch.zeros(8, 3), "keep"], "p": Pair(torch.ones(4), 7)},
        torch.zeros(2, 8),
        torch.zeros(8),
        Sliceable(list(range(8))),
        2.5,
        kw=torch.ones(4, 2),
    )
    assert len(seen) == 4
    assert seen[1] == (
        torch.Size([2]),
        torch.Size([2, 3]),
        "keep",
        torch.Size([1]),
        7,
        torch.Size([2, 2]),
        torch.Size([8]),
        [2, 3],
        2.5,
        torch.Size([1, 2]),
    )
    assert isinstance(out, smp.StepOutput) and len(out.outputs) == 4
    assert out.reduce_sum().item() == sum(range(8))
    assert out.reduce_mean().item() == sum(range(8)) / 4
    assert out.stack().shape == (4,)


def test_indivisible_batch_names_argument_size_and_count(single_process_smp):
    smp = single_process_smp({"microbatches": 4})
    model = smp.DistributedModel(Recorder())
    calls = []

    @smp.step
    def f(model, batch):
        calls.append(1)
        return model(batch["ids"]).sum()

    with pytest.raises(ValueError) as info:
        f(model, {"ids": torch.zeros(6)})
    message = str(info.value)
    assert "'batch'['ids']" in message and "size 6" in message and "microbatches=4" in message
    assert calls == []  # nothing ran


def test_options_must_name_real_arguments(single_process_smp):
    smp = single_process_smp({})
    with pytest.raises(ValueError, match="'masks'"):

        @smp.step(non_split_inputs=["masks"])
        def f(model, mask):
            pass


def test_nested_outputs_become_step_outputs(single_process_smp):
    smp = single_process_smp({"microbatches": 2})
    model = smp.DistributedModel(Recorder())

    @smp.step
    def f(model, x):
        y = model(x)
        model.backward(y.sum())
        return {"loss": y.sum(), "parts": (y, 3)}

    out = f(model, torch.arange(4.0))
    assert set(out) == {"loss", "parts"}
    assert out["loss"].outputs[0].item() == 1.0 and out["loss"].outputs[1].item() == 5.0
    assert not out["loss"].outputs[0].requires_grad  # detached
    torch.testing.assert_close(out["parts"][0].concat(), torch.arange(4.0))
    assert out["parts"][1].outputs == [3, 3]
    # Two microbatches averaged: d(sum x)/dw = mean of per-microbatch sums.
    assert model.module.w.grad.item() == 3.0


def test_evaluation_step_leaves_gradients_alone(single_process_smp):
    smp = single_process_smp({"microbatches": 2})
    model = smp.DistributedModel(Recorder())

    @smp.step
    def evaluate(model, x):
        return model(x)

    with torch.no_grad():
        out = evaluate(model, torch.arange(4.0))
    assert model.module.w.grad is None
    torch.testing.assert_close(out.concat(), torch.arange(4.0))


def test_backward_and_optimizer_step_are_checked(single_process_smp):
    smp = single_process_smp({})
    model = smp.DistributedModel(Recorder())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(RuntimeError, match="inside a function decorated with @smp.step"):
        model.backward(model(torch.ones(1)).sum())

    @smp.step
    def bad(model, x):
        optimizer.step()

    with pytest.raises(RuntimeError, match="after the @smp.step function returns"):
        bad(model, torch.ones(2))

    @smp.step
    def nested(model, x):
        return bad(model, x)

    with pytest.raises(RuntimeError, match="cannot be nested"):
        nested(model, torch.ones(2))

    @smp.step
    def closure(x):  # the model is not an argument: smp would not reduce its gradients
        model.backward(model(x).sum())

    with pytest.raises(RuntimeError, match="not an argument of the @smp.step function"):
        closure(torch.ones(2))
    assert all(p.grad is None for p in model.parameters())


def test_a_bad_optimizer_says_so(single_process_smp):
    smp = single_process_smp()
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        smp.DistributedOptimizer(object())


def test_rewind_snapshot_follows_the_model_without_walking_it_each_step(monkeypatch):
    """_Rewind (a pipelined step's snapshot) keeps each model's buffer and parameter lists
    across steps (Note [Rewind without walking the model]) and sees every change that matters:
    a registered buffer, a new submodule, a replaced parameter and a buffer reassigned under its
    old name."""
    import importlib
    import types

    step_module = importlib.import_module("smp.step")
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model = types.SimpleNamespace(module=net, _changing_buffers=set(), _window_position=0)

    def snapshot():
        rewind = step_module._Rewind(None, [model])
        return {e[3]: e[4] for e in rewind.buffers}, {n: p for n, p, _ in rewind.params}

    buffers, params = snapshot()
    assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert set(params) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    # Nothing registered since: the lists are not built again.
    with monkeypatch.context() as m:
        m.setattr(net, "named_modules", lambda *a, **k: pytest.fail("walked the modules"))
        m.setattr(net, "named_parameters", lambda *a, **k: pytest.fail("walked the params"))
        assert snapshot() == (buffers, params)

    net[0].register_buffer("scale", torch.ones(2))
    net.append(nn.BatchNorm1d(2))
    net[0].weight = nn.Parameter(torch.zeros(2, 2))
    fresh = torch.zeros(2)
    net[1].running_mean = fresh  # an existing buffer's name: torch runs no hook for this
    buffers, params = snapshot()
    assert {"0.scale", "2.running_mean", "2.running_var"} <= set(buffers)
    assert params["0.weight"] is net[0].weight and "2.weight" in params
    assert buffers["1.running_mean"] is fresh

"""Activation checkpointing and offloading in one process: the strategies, the RNG, autocast, what
is kept, what moves to the host and when, and the errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import smp
from smp.memory import activations


def _stack(n: int = 6, p: float = 0.2) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(n):
        layers += [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(p))]
    return nn.Sequential(*layers)


def _run(model: nn.Module, seed: int = 3, run=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = torch.randn(4, 8, requires_grad=True)
    out = (run or model)(x)
    out.square().sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def _same(a, b) -> None:
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(g, h) for g, h in zip(a[2], b[2]))


def _recomputes(model: nn.Sequential) -> list[int]:
    counts = [0] * len(model)
    for i, child in enumerate(model):
        child[0].register_forward_pre_hook(
            lambda *_, i=i: (
                counts.__setitem__(i, counts[i] + 1)
                if torch._C._current_graph_task_id() != -1
                else None
            )
        )
    return counts


@pytest.mark.parametrize("strategy", ["each", "group_2", "group_4", "contiguous"])
def test_sequential_strategies_change_no_number_and_recompute_once(strategy):
    reference = _stack()
    model = copy.deepcopy(reference)
    smp.set_activation_checkpointing(model, strategy=strategy)
    counts = _recomputes(model)
    _same(_run(reference), _run(model))  # dropout on: the recompute drew the same masks
    assert counts == [1] * 6, counts  # alone or in a group, each layer ran once more


def test_checkpoint_sequential_and_checkpoint_match_the_plain_calls():
    reference = _stack()
    model = copy.deepcopy(reference)
    _same(
        _run(reference), _run(model, run=lambda x: smp.checkpoint_sequential(model, x, "group_3"))
    )
    model = copy.deepcopy(reference)
    _same(_run(reference), _run(model, run=lambda x: smp.checkpoint(model, x)))


def test_without_preserved_rng_the_recompute_draws_other_masks():
    reference = _stack(p=0.5)
    model = copy.deepcopy(reference)
    smp.set_activation_checkpointing(model, preserve_rng_state=False)
    a, b = _run(reference), _run(model)
    assert torch.equal(a[0], b[0])  # the forward is the same
    assert not all(torch.equal(g, h) for g, h in zip(a[2], b[2]))  # the gradients are not


def test_autocast_state_is_the_forwards():
    reference = _stack(p=0.0)
    model = copy.deepcopy(reference)
    smp.set_activation_checkpointing(model)

    def under_autocast(m):
        def run(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(x).float()

        return run

    _same(_run(reference, run=under_autocast(reference)), _run(model, run=under_autocast(model)))


def test_only_the_inputs_are_kept():
    model = _stack(n=4, p=0.0)
    smp.set_activation_checkpointing(model)
    saved = []
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(x)
    assert saved == []  # every tensor the layers save waits for the recompute
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_module_list_and_a_whole_module():
    torch.manual_seed(0)
    reference = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
    model = copy.deepcopy(reference)
    smp.set_activation_checkpointing(model)

    def chain(m):
        def run(x):
            for layer in m:
                x = torch.tanh(layer(x))
            return x

        return run

    _same(_run(reference, run=chain(reference)), _run(model, run=chain(model)))
    assert all(activations.is_checkpointed(layer) for layer in model)


def test_in_place_modified_input_is_an_error():
    layer = nn.Linear(8, 8)
    smp.set_activation_checkpointing(layer)
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 1
    out = layer(h)
    h.add_(1)  # the recompute would see another input
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: smp.set_activation_checkpointing(nn.Linear(1, 1), strategy="pairs"), "group_<n>"),
        (lambda: smp.set_activation_checkpointing(nn.Linear(1, 1), strategy="group_0"), "group_0"),
        (lambda: smp.set_activation_checkpointing(nn.Linear(1, 1), strategy="group_2"), "nn.Seq"),
        (
            lambda: smp.set_activation_checkpointing(
                nn.ModuleList([nn.Linear(1, 1)]), strategy="contiguous"
            ),
            "ModuleList",
        ),
        (
            lambda: smp.set_activation_checkpointing(nn.Linear(1, 1), preserve_rng_state=1),
            "True or False",
        ),
        (lambda: smp.set_activation_checkpointing("layer"), "nn.Module"),
        (lambda: smp.checkpoint_sequential(nn.Linear(1, 1), torch.ones(1)), "nn.Sequential"),
    ],
)  # fmt: skip
def test_bad_arguments_name_the_value(call, words):
    with pytest.raises(ValueError, match="smp") as info:
        call()
    assert words in str(info.value)


def test_the_wrapped_model_itself_is_refused(single_process_smp):
    single_process_smp()
    model = smp.DistributedModel(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="DistributedModel itself"):
        smp.set_activation_checkpointing(model)


def _offload_run(smp, offload: bool, horizon: int = 1):
    smp.init({"microbatches": 4, "offload_activations": offload,
              "activation_loading_horizon": horizon})  # fmt: skip
    module = _stack()
    smp.set_activation_checkpointing(module)
    model = smp.DistributedModel(module)

    @smp.step
    def train_step(model, x):
        loss = model(x).square().sum()
        model.backward(loss)
        return loss

    torch.manual_seed(1)
    losses = [train_step(model, torch.randn(8, 8)).reduce_mean() for _ in range(2)]
    grads = [p.grad.clone() for p in model.parameters()]
    moves = smp.memory.offload.current().moves if offload else []
    smp.shutdown()
    return losses, grads, moves


def test_offloading_moves_every_frame_out_and_back_and_changes_no_number():
    plain = _offload_run(smp, False)
    moved = _offload_run(smp, True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], moved[0]))
    assert all(torch.equal(a, b) for a, b in zip(plain[1], moved[1]))
    moves = moved[2]
    out = [m for m in moves if m.direction == "out"]
    back = [m for m in moves if m.direction == "in"]
    # 6 checkpointed layers x 4 microbatches x 2 steps, each input (2 x 8 floats) out once,
    # back once, and in microbatch order.
    assert len(out) == len(back) == 48
    assert {m.nbytes for m in moves} == {2 * 8 * 4}
    assert [m.microbatch for m in out] == [
        mb for _ in range(2) for mb in range(4) for _ in range(6)
    ]
    # One process runs each microbatch's backward right after its forward: the first frame
    # needed is a miss, the rest of the microbatch comes back ahead of its recompute.
    assert sum(not m.ahead for m in back) == 8


def test_offload_config_needs_no_checkpointing_to_do_nothing(single_process_smp):
    smp = single_process_smp({"offload_activations": True})
    model = smp.DistributedModel(nn.Linear(2, 2))

    @smp.step
    def train_step(model, x):
        loss = model(x).sum()
        model.backward(loss)
        return loss

    train_step(model, torch.ones(2, 2))
    assert smp.memory.offload.current().moves == []

"""Tensor-parallel building blocks, registration, marking, bad input and randomness.

Parity of torch.nn models whose layers were marked (built-in registrations for Linear, Embedding
and LayerNorm, with smp's batch semantics), a user registration with hooks, clear errors and
warnings, and reproducible TP-aware dropout.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from models import parity_adamw
from test_tp_parity import LM, full_grads
from torch import nn

TOL = dict(rtol=1e-5, atol=1e-5)


class Tagger(nn.Module):
    """Embedding -> LayerNorm -> two Linears: every built-in registration in one model."""

    def __init__(self, vocab=32, d=16, hidden=24, classes=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, ids):
        return self.out(torch.tanh(self.fc(self.norm(self.embed(ids)))))


def _builtin_worker(tp: int) -> list[float]:
    import smp

    smp.init({"tensor_parallel_degree": tp})
    torch.manual_seed(3)
    reference = Tagger()
    with smp.tensor_parallelism():
        torch.manual_seed(3)
        marked = Tagger()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every marked module divides: no warning
        model = smp.DistributedModel(marked)
    assert sorted(model.distributed_modules) == ["embed", "fc", "norm", "out"]
    assert type(model.module.fc).__name__ == "DistributedLinear"
    assert model.module.fc.weight.shape == (24, 16 // tp)  # pretrained weights sharded in
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    reference_optimizer = parity_adamw(reference.parameters())

    @smp.step
    def train_step(model, ids, target):
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        model.backward(loss)
        return loss

    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 32, (4 * smp.dp_size(), 5), generator=g)
        target = torch.randint(0, 6, (4 * smp.dp_size(), 5), generator=g)
        mine = slice(smp.dp_rank() * 4, smp.dp_rank() * 4 + 4)
        optimizer.zero_grad()
        loss = train_step(model, ids[mine], target[mine]).reduce_mean().item()
        global_loss = sum(smp.allgather(loss, smp.DP_GROUP)) / smp.dp_size()
        reference_optimizer.zero_grad()
        reference_loss = F.cross_entropy(reference(ids).flatten(0, 1), target.flatten())
        reference_loss.backward()
        assert abs(global_loss - reference_loss.item()) < 1e-5, (global_loss, reference_loss)
        grads = full_grads(model)
        for name, q in reference.named_parameters():
            torch.testing.assert_close(grads[name], q.grad, **TOL, msg=lambda m, n=name: f"{n} {m}")
        optimizer.step()
        reference_optimizer.step()
        for name, q in reference.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], q, **TOL)
        losses.append(global_loss)
    return losses


def test_builtin_registrations_parity(pools):
    results = pools.run(2, _builtin_worker, 2)
    assert all(r == results[0] for r in results)


def test_builtin_registrations_parity_tp2_dp2(pools):
    results = pools.run(4, _builtin_worker, 2)
    assert all(r == results[0] for r in results)


# ---- user registration ---------------------------------------------------------------------------


class Scaler(nn.Module):
    """y = scale * (x @ W^T); constructor (d, scale), forward(x, *, twice=False)."""

    def __init__(self, d: int, scale: float):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d))
        self.scale = scale

    def forward(self, x, twice=False):
        return {"y": self.scale * (2 if twice else 1) * (x @ self.weight.t())}


def _make_dist_scaler():
    import smp

    class DistScaler(smp.nn.DistributedModule):
        """Column-parallel Scaler: same state-dict key, full shapes sharded by smp."""

        def __init__(self, size, factor):
            super().__init__()
            self._check_divisible("size", size)
            self.factor = factor
            self.weight = self._shard(torch.zeros(size, size), 0)

        def local_forward(self, x, multiplier):
            y = F.linear(smp.tp.functional.copy_to_region(x), self.weight)
            return self.factor * multiplier * smp.tp.functional.gather_from_region(y, -1)

    return DistScaler


def _user_registration_worker(d: int) -> dict:
    import smp

    smp.init({"tensor_parallel_degree": 2})
    calls = []

    def init_hook(d, scale):
        calls.append("init")
        return (), {"size": d, "factor": scale}

    def forward_hook(x, twice=False):
        calls.append("forward")
        return (x, 2.0 if twice else 1.0), {}

    def return_hook(y):
        return {"y": y}

    smp.tp_register_with_module(Scaler, _make_dist_scaler(), init_hook, forward_hook, return_hook)
    torch.manual_seed(0)
    reference = Scaler(d, 0.5)
    with smp.tensor_parallelism():
        torch.manual_seed(0)
        marked = Scaler(d, 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = smp.DistributedModel(marked)
    x = torch.randn(3, d) + smp.dp_rank()
    expected = reference(x, twice=True)["y"]
    out = model.module(x, twice=True)["y"]
    torch.testing.assert_close(out, expected, **TOL)
    return {
        "calls": calls,
        "distributed": model.distributed_modules,
        "warnings": [str(w.message) for w in caught],
        "state_shape": tuple(model.state_dict()["weight"].shape),
    }


def test_user_registration_with_hooks(pools):
    for r in pools.run(2, _user_registration_worker, 4):
        assert r["calls"] == ["init", "forward"], r
        assert r["distributed"] == ["<root>"]
        assert r["state_shape"] == (4, 4)


def test_indivisible_marked_module_stays_whole_with_warning(pools):
    for r in pools.run(2, _user_registration_worker, 5):
        assert r["distributed"] == []
        assert len(r["warnings"]) == 1
        assert "<root> (Scaler)" in r["warnings"][0] and "size = 5" in r["warnings"][0]
        assert "tensor-parallel degree 2" in r["warnings"][0]
        assert r["state_shape"] == (5, 5)


def _explicit_indivisible_worker() -> str:
    import smp

    smp.init({"tensor_parallel_degree": 2})
    try:
        smp.nn.DistributedLinear(16, 7, split="column")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_explicit_indivisible_linear_raises(pools):
    for message in pools.run(2, _explicit_indivisible_worker):
        assert "7" in message and "degree 2" in message, message


def _tied_worker() -> list[str]:
    import smp

    smp.init({"tensor_parallel_degree": 2})

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    with smp.tensor_parallelism():
        model = Tied()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        smp.DistributedModel(model)
    return [str(w.message) for w in caught]


def test_tied_weights_stay_whole(pools):
    for messages in pools.run(2, _tied_worker):
        assert len(messages) == 2, messages
        assert all("shared with" in m for m in messages), messages


# ---- randomness ----------------------------------------------------------------------------------


def _dropout_worker(seed: int) -> dict:
    import smp
    from smp.nn import DistributedTransformerLMHead

    smp.init({"tensor_parallel_degree": 2, "tensor_parallel_seed": seed})
    torch.manual_seed(0)
    dropout = dict(attention_dropout_prob=0.2, hidden_dropout_prob=0.2, embedding_dropout_prob=0.2)
    model = smp.DistributedModel(DistributedTransformerLMHead(**{**LM, **dropout}))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, ids):
        loss = model(ids, labels=ids).mean()
        model.backward(loss)
        return loss

    losses = []
    for step in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        losses.append(train_step(model, ids).reduce_mean().item())
        optimizer.step()
    # Replicated parameters stay identical across the TP group only if every rank drew the same
    # dropout masks on replicated activations.
    replicated = {
        n: p.detach().clone()
        for n, p in model.module.named_parameters()
        if getattr(p, "_smp_tp_split", None) is None
    }
    gathered = smp.allgather(replicated, smp.TP_GROUP)
    same = all(torch.equal(gathered[0][n], gathered[1][n]) for n in replicated)
    return {"losses": losses, "replicated_equal": same}


def test_tp_dropout_is_reproducible_and_consistent(pools):
    first = pools.run(2, _dropout_worker, 7)
    second = pools.run(2, _dropout_worker, 7)
    other = pools.run(2, _dropout_worker, 8)
    assert [r["losses"] for r in first] == [r["losses"] for r in second]
    assert first[0]["losses"] != other[0]["losses"]
    assert all(r["replicated_equal"] for r in first)


# ---- failures ------------------------------------------------------------------------------------


def _failing_tp_rank_worker() -> tuple[str, str, float]:
    import time

    import smp

    smp.init({"tensor_parallel_degree": 2, "timeout_s": 8})
    torch.manual_seed(0)
    model = smp.DistributedModel(Tagger())  # not marked: the model itself is replicated
    layer = smp.nn.DistributedLinear(16, 8, split="column")  # ...but this layer is split

    @smp.step
    def train_step(model, ids):
        if smp.tp_rank() == 1:
            raise KeyError("boom on TP rank 1")
        hidden = model.module.embed(ids)
        loss = layer(hidden).square().mean()  # TP rank 0 waits in a collective
        model.backward(loss)
        return loss

    start = time.monotonic()
    try:
        train_step(model, torch.randint(0, 32, (2, 4)))
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_failure_on_one_tp_rank_reaches_every_rank(pools):
    """TP rank 0 waits in a collective that rank 1 never joins: it fails after timeout_s, and
    then learns the cause at the step's outcome agreement, which waits longer than that."""
    (kind0, message0, seconds0), (kind1, message1, _) = pools.run(
        2, _failing_tp_rank_worker, timeout_s=120
    )
    assert kind1 == "KeyError" and "boom on TP rank 1" in message1, (kind1, message1)
    assert kind0 == "StepFailedError", (kind0, message0)
    assert "smp.step failed on rank 1" in message0 and "boom on TP rank 1" in message0, message0
    assert "on this rank:" in message0, message0
    assert seconds0 < 60, seconds0

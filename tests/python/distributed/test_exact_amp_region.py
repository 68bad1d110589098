"""No silent wrong numbers: ``smp.amp.GradScaler`` with a float16 model, the TP
agreement on arguments that are not plain values, and the glibc mmap threshold of delayed
parameter initialisation.

GradScaler: a float16 model (``smp.model_creation(dtype=torch.float16)``) at dp 2 trains with
float32 master weights in ``smp.DistributedOptimizer`` (design.md §8). The user's loop —
``model.backward(scaler.scale(loss))`` in the step, ``scaler.step(optimizer)``,
``scaler.update()``, optionally ``scaler.unscale_(optimizer)`` and
``optimizer.clip_grad_norm_`` before the step — is compared with one process doing the same by
hand as test_master_weights.py does (each replica's scaled float16 gradients, averaged in
float16 as the data-parallel reduction does, copied to float32 masters, then torch's own
``GradScaler`` unscaling / skipping / stepping the masters, the masters copied back): the loss,
the masters' gradients, the masters and the parameters after each step, and the scale. A first
step with a huge scale overflows, is skipped on every rank, and lowers the scale as torch's
does. Clipping the model's float16 gradients after ``unscale_`` (which the masters would not
see) raises a named error on every rank before the step. torch's own ``GradScaler`` is refused
where it cannot be exact (float32 masters, tensor parallelism) and allowed where it is (a
float32 model, data parallel only).

Agreement: TP ranks that pass a region values that differ — a ``Fraction``, a ``numpy.float32``,
a dict with tuple keys, each ``1 + rank`` — run each rank's arguments in turn (each rank's
output equals one process's for its own value); equal values do not run in turn.

mmap threshold: ``smp.delay_param_initialization`` with no ``DistributedModel`` after it, and
one left by an exception, leave glibc's threshold where smp found it (recorded through a fake
libc handle).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import fractions

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

REPLICAS = 2
LR = 0.1
MAX_NORM = 0.05  # small enough that every step clips
# Both sides compute the same float16 backward, average the same float16 gradients and step
# float32 masters with the same operations: bit for bit.
EXACT = dict(rtol=0, atol=0)


def _fp16_model(smp):
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.float16):
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int, replica: int):
    g = torch.Generator().manual_seed(100 * step + replica)
    return torch.randn(4, 8, generator=g).half(), torch.randn(4, 4, generator=g)


def _loss(model, x, y):
    return F.mse_loss(model(x).float(), y)


class _Reference:
    """One process: a float16 model, float32 masters stepped by torch's SGD under torch's
    GradScaler, the masters copied back into the model."""

    def __init__(self, module: nn.Module, scaler_args: dict, fused: bool):
        self.model = module
        self.masters = [p.detach().float().requires_grad_() for p in module.parameters()]
        self.optimizer = torch.optim.SGD(self.masters, lr=LR, fused=fused)
        self.scaler = torch.amp.GradScaler("cpu", **scaler_args)

    def step(self, step: int, clip: bool) -> tuple[float, list[torch.Tensor]]:
        losses, grads = [], []
        for replica in range(REPLICAS):  # each replica's backward, as each dp rank runs it
            self.model.zero_grad()
            loss = _loss(self.model, *_batch(step, replica))
            self.scaler.scale(loss).backward()
            losses.append(loss.item())
            grads.append([p.grad.clone() for p in self.model.parameters()])
        for master, *per_replica in zip(self.masters, *grads):
            master.grad = (sum(per_replica) / REPLICAS).float()  # the fp16 dp average
        self.scaler.unscale_(self.optimizer)
        if clip:
            torch.nn.utils.clip_grad_norm_(self.masters, MAX_NORM)
        unscaled = [m.grad.clone() for m in self.masters]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        with torch.no_grad():
            for master, p in zip(self.masters, self.model.parameters()):
                p.copy_(master)
        return sum(losses) / REPLICAS, unscaled


def _amp_worker(variant: str) -> dict:
    """``variant``: "plain" (scale, step, update), "clip" (unscale_ and
    optimizer.clip_grad_norm_ before the step), "fused" (plain, with SGD(fused=True), which
    unscales inside its own step), "torch_clip" (torch's clip of the model's float16 gradients
    after unscale_: must raise)."""
    import smp
    from smp.optimizer import MasterGradientsChangedError

    smp.init({})
    module = _fp16_model(smp)
    fused = variant == "fused"
    clip = variant == "clip"
    out: dict = {"steps": []}
    # A huge first scale overflows float16 at once; the backoff then lands on 2**10, which
    # does not overflow, so later steps update.
    scaler_args = dict(init_scale=2.0**40, backoff_factor=2.0**-30, growth_interval=2)
    if variant == "torch_clip":  # a skipped step never reaches optimizer.step(): no overflow
        scaler_args["init_scale"] = 2.0**10
    reference = _Reference(copy.deepcopy(module), scaler_args, fused)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, fused=fused))
    scaler = smp.amp.GradScaler(**scaler_args)

    @smp.step
    def train_step(model, x, y):
        loss = _loss(model, x, y)
        model.backward(scaler.scale(loss))
        return loss

    for step in range(4):
        optimizer.zero_grad()
        loss = train_step(model, *_batch(step, smp.dp_rank())).reduce_mean()
        loss = sum(smp.allgather(loss.item(), smp.DP_GROUP)) / REPLICAS
        before = [p.detach().clone() for p in model.parameters()]
        if clip or variant == "torch_clip":
            scaler.unscale_(optimizer)
            if variant == "torch_clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                try:
                    scaler.step(optimizer)
                except MasterGradientsChangedError as exc:
                    out["error"] = str(exc)
                out["unchanged"] = all(
                    torch.equal(p, b) for p, b in zip(model.parameters(), before)
                )
                return out
            optimizer.clip_grad_norm_(MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
        masters = [m for g in optimizer.param_groups for m in g["params"]]
        grads = [m.grad for m in masters]  # unscaled (and clipped) by now
        expected_loss, expected_grads = reference.step(step, clip)
        skipped = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        out["steps"].append((skipped, scaler.get_scale(), reference.scaler.get_scale()))
        assert loss == expected_loss, (step, loss, expected_loss)
        if step > 0:  # the skipped step's gradients are inf: nothing to compare
            for i, (got, want) in enumerate(zip(grads, expected_grads)):
                torch.testing.assert_close(
                    got, want, **EXACT, msg=lambda m, i=i, s=step: f"{s} {i} {m}"
                )
        for i, (got, want) in enumerate(zip(masters, reference.masters)):
            torch.testing.assert_close(
                got, want, **EXACT, msg=lambda m, i=i, s=step: f"{s} {i} {m}"
            )
        for got, want in zip(model.parameters(), reference.model.parameters()):
            assert got.dtype == torch.float16
            torch.testing.assert_close(got, want, **EXACT)
    return out


@pytest.mark.parametrize("variant", ["plain", "clip", "fused"])
def test_grad_scaler_with_float16_model_matches_one_process(pools, variant):
    for result in pools.run(REPLICAS, _amp_worker, variant, timeout_s=120):
        steps = result["steps"]
        # The first step overflows: skipped, and the scale drops as torch's does.
        assert steps[0] == (True, 2.0**10, 2.0**10), steps
        assert not any(s[0] for s in steps[1:]), steps
        assert all(s[1] == s[2] for s in steps), steps


def test_clipping_the_float16_gradients_after_unscale_raises(pools):
    for result in pools.run(REPLICAS, _amp_worker, "torch_clip", timeout_s=120):
        assert "optimizer.clip_grad_norm_" in result.get("error", ""), result
        assert "torch.nn.utils.clip_grad_norm_" in result["error"], result
        assert result["unchanged"], result


class _Half(nn.Module):
    def forward(self, x):
        return x.half()


def _torch_scaler_worker(layout: str) -> dict:
    """torch's own GradScaler (not smp's) stepping a DistributedOptimizer: "mixed" (a float16
    model with a float32 layer at dp 2: torch unscales the float32 layer's gradients only, the
    masters get the scaled ones), "tp2" (a float32 model, tensor parallel: each rank would
    decide alone whether to skip), "dp2" (a float32 model, data parallel only: exact, allowed).
    (Under pipeline parallelism torch's scaler fails by itself on the stages that do not run
    the step function: it never scaled there.)"""
    import smp

    smp.init({"tensor_parallel_degree": 2} if layout == "tp2" else {})
    torch.manual_seed(0)
    if layout == "mixed":  # the first layer float32, the second float16
        module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), _Half(), nn.Linear(16, 4).half())
    else:
        with smp.tensor_parallelism(layout == "tp2"):
            module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x).float(), y)
        model.backward(scaler.scale(loss))
        return loss

    x, y = _batch(0, smp.dp_rank())
    train_step(model, x.float(), y)
    before = [p.detach().clone() for p in model.local_parameters()]
    try:
        scaler.step(optimizer)
        error = None
    except ValueError as exc:
        error = str(exc)
    changed = any(not torch.equal(p, b) for p, b in zip(model.local_parameters(), before))
    return {"error": error, "changed": changed}


@pytest.mark.parametrize("layout", ["mixed", "tp2", "dp2"])
def test_torch_grad_scaler_is_refused_where_it_cannot_be_exact(pools, layout):
    for result in pools.run(2, _torch_scaler_worker, layout, timeout_s=120):
        if layout == "dp2":
            assert result == {"error": None, "changed": True}, result
        else:
            assert "Use smp.amp.GradScaler" in (result["error"] or ""), result
            assert not result["changed"], result


# ---- TP agreement on values that are not plain --------------------------------------------------

D_IN, D_OUT = 4, 8


def _value(kind: str, rank: int):
    """What TP rank ``rank`` passes the region in case ``kind`` (1 + rank unless they agree)."""
    v = 1 + rank
    return {
        "fraction": fractions.Fraction(v, 3),
        "numpy": np.float32(v),
        "tuple_keys": {(0, "scale"): float(v)},
        "float": float(v),
        "agree": fractions.Fraction(5, 3),
        "lambda": lambda: float(v),
    }[kind]


def _number(value) -> float:
    if isinstance(value, dict):
        return value[(0, "scale")]
    return float(value() if callable(value) else value)


def _region_worker(kind: str) -> dict:
    """A column-parallel module whose shards scale by the value: a rank running another rank's
    value on its shard shows as a column block of the wrong scale."""
    import smp
    from smp.tp import functional as tpf
    from smp.tp import region

    class Scaled(smp.nn.DistributedModule):
        def __init__(self, weight: torch.Tensor):
            super().__init__()
            self.weight = self._shard(weight.clone(), 0)

        def local_forward(self, x, value):
            y = F.linear(tpf.copy_to_region(x), self.weight) * _number(value)
            return tpf.gather_from_region(y, -1)

    smp.init({"tensor_parallel_degree": 2})
    rank = smp.tp_rank()
    torch.manual_seed(0)
    weight = torch.randn(D_OUT, D_IN)
    module = Scaled(weight)

    def inputs(r: int):
        g = torch.Generator().manual_seed(10 + r)
        return torch.randn(3, D_IN, generator=g), torch.randn(3, D_OUT, generator=g)

    runs, original = [], region._run_in_turn

    def counted(*args, **kwargs):
        runs.append(1)
        return original(*args, **kwargs)

    region._run_in_turn = counted
    x, g = inputs(rank)
    x.requires_grad_()
    try:
        out = module(x, _value(kind, rank))
    except smp.DivergentArgumentsError as exc:
        return {"error": str(exc)}
    finally:
        region._run_in_turn = original
    (out * g).sum().backward()

    # One process: the full weight, each rank's own samples and value; the weight's gradient
    # is that of the sum of every rank's objective (the group's batch).
    full = weight.clone().requires_grad_()
    expected, x_grad = None, None
    for r in range(2):
        xr, gr = inputs(r)
        xr.requires_grad_()
        yr = F.linear(xr, full) * _number(_value(kind, r))
        (yr * gr).sum().backward()
        if r == rank:
            expected, x_grad = yr.detach(), xr.grad
    rows = slice(rank * D_OUT // 2, (rank + 1) * D_OUT // 2)
    return {
        "ratio": (out.detach() / expected).mean(0).tolist(),
        "out": torch.equal(out.detach(), expected),
        "x_grad": torch.allclose(x.grad, x_grad, rtol=1e-6, atol=1e-6),
        "w_grad": torch.allclose(module.weight.grad, full.grad[rows], rtol=1e-6, atol=1e-6),
        "runs_in_turn": len(runs),
    }


@pytest.mark.parametrize("kind", ["fraction", "numpy", "tuple_keys", "float", "agree"])
def test_tp_ranks_with_different_values_match_one_process(pools, kind):
    for result in pools.run(2, _region_worker, kind, timeout_s=60):
        assert "error" not in result, result
        assert result["out"] and result["x_grad"] and result["w_grad"], result
        # Different values run in turn; equal ones do not have to.
        assert result["runs_in_turn"] == (0 if kind == "agree" else 1), result


def test_tp_argument_smp_cannot_compare_is_refused_on_every_rank(pools):
    for rank, result in enumerate(pools.run(2, _region_worker, "lambda", timeout_s=60)):
        message = result.get("error", "")
        assert "argument 1 is a function" in message and "cannot compare" in message, result
        assert f"this is TP rank {rank}" in message, message


@dataclasses.dataclass
class Config:
    scale: float


class Color(enum.Enum):
    RED = 1
    BLUE = 2


def test_argument_digests_follow_contents():
    """The agreement's digest of equal contents is equal, of different contents different (no
    processes): what "contents" means for values that are not plain."""
    from smp.tp.agreement import _Call

    block = torch.nn.Identity()

    def digest(value):
        return _Call.describe(block, (torch.zeros(2), value), {}).digest().tolist()

    same = [
        (fractions.Fraction(1, 3), fractions.Fraction(2, 6)),
        (np.float32(2), np.float32(2)),
        ({(0, "a"): 1.0}, {(0, "a"): 1.0}),
        ({"a", "b", "c"}, {"c", "b", "a"}),
        (Config(1.0), Config(1.0)),
        (np.arange(3), np.arange(3)),
        (Color.RED, Color.RED),
        (None, None),
    ]
    different = [
        (fractions.Fraction(1, 3), fractions.Fraction(2, 3)),
        (np.float32(1), np.float32(2)),
        (np.float32(1), np.float64(1)),
        ({(0, "a"): 1.0}, {(0, "a"): 2.0}),
        ({(0, "a"): 1.0}, {(0, "b"): 1.0}),
        ({"a", "b"}, {"a", "c"}),
        (Config(1.0), Config(2.0)),
        (np.arange(3), np.arange(3) + 1),
        (Color.RED, Color.BLUE),
        (None, 0),
        (1.0, np.float64(1.0)),
    ]
    for a, b in same:
        assert digest(a) == digest(b), (a, b)
    for a, b in different:
        assert digest(a) != digest(b), (a, b)


# ---- glibc's mmap threshold ---------------------------------------------------------------------


class _FakeLibc:
    """Records mallopt calls instead of making them."""

    def __init__(self):
        self.calls = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


M_TRIM, M_MMAP = -1, -3
CEILING = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


def test_delayed_init_puts_the_mmap_threshold_back_however_it_ends(monkeypatch):
    import smp
    from smp.memory import delayed

    libc = _FakeLibc()
    monkeypatch.setattr(delayed, "_glibc", lambda: libc)
    for name in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    put_back = [(M_MMAP, CEILING), (M_TRIM, 2 * CEILING)]

    with smp.delay_param_initialization():  # no DistributedModel follows
        nn.Linear(4, 4)
    assert libc.calls == [(M_MMAP, 1 << 20), *put_back], libc.calls

    libc.calls.clear()
    with pytest.raises(RuntimeError, match="constructor failed"), smp.delay_param_initialization():
        with delayed.returning_memory():  # nested: only the outermost puts it back
            nn.Linear(4, 4)
        assert libc.calls == [(M_MMAP, 1 << 20)], libc.calls
        raise RuntimeError("the model's constructor failed")
    assert libc.calls == [(M_MMAP, 1 << 20), *put_back], libc.calls
    assert delayed._mapping[0] == 0 and delayed._threshold_set[0] == CEILING

    # What glibc had at startup, from the environment it reads: a threshold the user chose
    # comes back as it was; another setting chosen means glibc's initial one, static.
    settings = delayed._glibc_settings
    assert settings({}) == put_back
    assert settings({"MALLOC_MMAP_THRESHOLD_": "65536"}) == [(M_MMAP, 65536)]
    tunables = "glibc.malloc.mmap_threshold=0x40000:glibc.malloc.trim_threshold=1"
    assert settings({"GLIBC_TUNABLES": tunables}) == [(M_MMAP, 0x40000)]
    assert settings({"GLIBC_TUNABLES": "glibc.malloc.top_pad=4096"}) == [(M_MMAP, 128 * 1024)]

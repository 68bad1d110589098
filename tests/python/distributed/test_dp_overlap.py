"""The gradient reduction overlapped with the backward (smp/reduction.py, design.md §2a).

Small buckets (a few KiB) so that the tiny models here have many, issued during the last
microbatch's backward. Every test compares with one process computing the same global batch:
the loss, every gradient, the parameters after the optimizer. Each rank has its own data: an
unmodified Hugging Face Llama with padding on one rank only and a different length on each.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.nn.functional as F
from models import tiny_hf_model
from torch import nn

TOL = dict(rtol=1e-5, atol=1e-5)
SMALL_BUCKETS_MB = 4 / 1024  # 4 KiB


def _rank_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's Llama batch of ``step``: 4 sequences of 8 - 2r tokens; rank 1 pads two of them
    on the right (mask 0, label -100), rank 0 pads none."""
    g = torch.Generator().manual_seed(100 * step + rank)
    length = 8 - 2 * rank
    ids = torch.randint(0, 64, (4, length), generator=g)
    mask = torch.ones(4, length, dtype=torch.long)
    if rank == 1:
        mask[1, length - 3 :] = 0
        mask[3, length - 1 :] = 0
    return ids, mask


def _llama_loss(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss


def _hf_worker(microbatches: int, passes: int, overlap: bool) -> dict:
    import smp

    smp.init({"microbatches": microbatches, "overlapping_allreduce": overlap})  # (config key)
    dp, rank = smp.dp_size(), smp.dp_rank()
    torch.manual_seed(0)
    reference = tiny_hf_model("llama")
    torch.manual_seed(0)
    model = smp.DistributedModel(
        tiny_hf_model("llama"),
        bucket_cap_mb=SMALL_BUCKETS_MB,
        backward_passes_per_step=passes,
    )
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    @smp.step
    def train_step(model, ids, mask):
        loss = _llama_loss(model, ids, mask)
        model.backward(loss)
        return loss

    issued_early = []
    for step in range(2 * passes):
        if step % passes == 0:
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
        loss = train_step(model, *_rank_batch(rank, step)).reduce_mean().item()
        reference_loss = 0.0
        for r in range(dp):  # the global batch: every rank's microbatches, each its own mean
            ids, mask = _rank_batch(r, step)
            for i, m in zip(ids.chunk(microbatches), mask.chunk(microbatches)):
                part = _llama_loss(reference, i, m) / (dp * microbatches)
                part.backward()
                if r == rank:
                    reference_loss += part.item() * dp
        assert abs(loss - reference_loss) < 1e-5, (step, loss, reference_loss)
        if step % passes == passes - 1:
            for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
            optimizer.step()
            reference_optimizer.step()
            for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                torch.testing.assert_close(p, q, **TOL, msg=lambda m, n=n: f"{n}: {m}")
            if overlap:
                issued_early.append(model._reduction.issued_early)
    assert (model._reduction is not None) == overlap
    buckets = len(model._reduction.buckets) if overlap else 0
    return {"issued_early": issued_early, "buckets": buckets}


@pytest.mark.parametrize(
    ("microbatches", "passes", "overlap"), [(1, 1, True), (2, 2, True), (2, 1, False)]
)
def test_hf_llama_different_data_per_rank(pools, microbatches, passes, overlap):
    results = pools.run(2, _hf_worker, microbatches, passes, overlap)
    if overlap:
        for result in results:
            # Every parameter is used, so every bucket went out during the backward.
            assert result["buckets"] > 10
            assert result["issued_early"] == [result["buckets"]] * 2


class _Branchy(nn.Module):
    """``b`` runs only where asked (rank 1 here); ``c`` never runs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 64)
        self.head = nn.Linear(64, 3)

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.a(x))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.head(h)


def _branchy_pair(smp, microbatches: int) -> tuple[int, nn.Module, nn.Module]:
    """(dp rank, a single-process reference, the same model under smp with small buckets)."""
    smp.init({"microbatches": microbatches})
    torch.manual_seed(0)
    reference = _Branchy()
    torch.manual_seed(0)
    model = smp.DistributedModel(_Branchy(), bucket_cap_mb=SMALL_BUCKETS_MB)
    return smp.dp_rank(), reference, model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _unused_worker() -> dict:
    import smp

    rank, reference, model = _branchy_pair(smp, 1)

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x, rank == 1), y)
        model.backward(loss)
        return loss

    issued = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        train_step(model, *_batch(rank, step))
        issued.append(model._reduction.issued_early)
        for r in range(2):
            x, y = _batch(r, step)
            (F.cross_entropy(reference(x, r == 1), y) / 2).backward()
        for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            if n.startswith("c."):
                assert p.grad is None, f"{n} is unused everywhere but got a gradient"
                continue
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
    return {"issued_early": issued, "buckets": len(model._reduction.buckets)}


def test_parameters_unused_on_one_rank_or_everywhere(pools):
    results = pools.run(2, _unused_worker)
    for result in results:
        # Issue order is head, c, b, a. In the first step c's bucket (and b's on rank 0) never
        # fills, so it and the later ones wait for the end; from then on the parameters that had
        # no gradient and that the backward cannot reach are final from its start.
        first, *later = result["issued_early"]
        assert first < result["buckets"]
        assert later == [result["buckets"]] * 2


def _stale_worker(kind: str) -> dict:
    import smp

    rank, reference, model = _branchy_pair(smp, 1)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("smp").addHandler(handler)

    def edit(module):
        with torch.no_grad():
            module.head.weight.grad.mul_(0.5)

    @smp.step
    def train_step(model, x, y):
        if kind == "two_backwards":  # the head gets a second accumulation after going out
            model.backward(F.cross_entropy(model(x, True), y))
            model.backward(model(x, False).square().mean())
        else:
            model.backward(F.cross_entropy(model(x, True), y))
            edit(model.module)

    for step in range(2):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        train_step(model, *_batch(rank, step))
        want = {n: torch.zeros_like(q) for n, q in reference.named_parameters()}
        for r in range(2):  # the mean over the ranks of each rank's (edited) gradient
            x, y = _batch(r, step)
            reference.zero_grad(set_to_none=True)
            loss = F.cross_entropy(reference(x, True), y)
            if kind == "two_backwards":
                loss = loss + reference(x, False).square().mean()
            loss.backward()
            if kind == "grad_edited":
                edit(reference)
            for n, q in reference.named_parameters():
                if q.grad is not None:
                    want[n] += q.grad / 2
        for n, p in model.module.named_parameters():
            if not n.startswith("c."):
                torch.testing.assert_close(p.grad, want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    logging.getLogger("smp").removeHandler(handler)
    return records


@pytest.mark.parametrize("kind", ["two_backwards", "grad_edited"])
def test_gradient_changed_after_its_bucket_went_out(pools, kind):
    records = pools.run(2, _stale_worker, kind)
    for rank_records in records:
        # Step 0 issues nothing early (the unused c holds the first bucket back, and the rest
        # follow it); step 1 knows c is idle, issues the head's bucket, and must reduce again.
        assert sum("reduced again" in r for r in rank_records) == 1, rank_records


def _failure_worker() -> dict:
    import smp

    rank, reference, model = _branchy_pair(smp, 2)
    fail = [False]

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x, True), y)
        if fail[0] and rank == 1 and smp.microbatch() == 1:
            raise KeyError("boom before the last backward")
        model.backward(loss)
        if fail[0] and rank == 0 and smp.microbatch() == 1:
            # Rank 0's buckets are all out; rank 1 never issues its own.
            assert model._reduction.issued() == len(model._reduction.buckets)
        return loss

    train_step(model, *_batch(rank, 0))
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    fail[0] = True
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        train_step(model, *_batch(rank, 1))
    elapsed = time.monotonic() - start
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(after) == len(before)
    for got, want in zip(after, before):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The next step is exact.
    fail[0] = False
    model.zero_grad(set_to_none=True)
    train_step(model, *_batch(rank, 2))
    for r in range(2):
        x, y = _batch(r, 2)
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            (F.cross_entropy(reference(xs, True), ys) / 4).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if not n.startswith("c."):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
    return {"error": f"{type(info.value).__name__}: {info.value}", "seconds": elapsed}


def test_failure_after_buckets_went_out_on_a_peer(pools):
    results = pools.run(2, _failure_worker)
    assert results[1]["error"].startswith("KeyError")
    assert "StepFailedError" in results[0]["error"] and "boom" in results[0]["error"]
    assert all(r["seconds"] < 10 for r in results), results

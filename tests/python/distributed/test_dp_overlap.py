"""The gradient reduction overlapped with the backward (smp/dp/reduction.py, design.md §2).

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
from models import assert_owned_grads_match, tiny_hf_model
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
                issued_early.append(model._grads.reduction.issued_early)
    assert (model._grads.reduction is not None) == overlap
    buckets = len(model._grads.reduction.buckets) if overlap else 0
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
        issued.append(model._grads.reduction.issued_early)
        for r in range(2):
            x, y = _batch(r, step)
            (F.cross_entropy(reference(x, r == 1), y) / 2).backward()
        for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            if n.startswith("c."):
                assert p.grad is None, f"{n} is unused everywhere but got a gradient"
                continue
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
    return {"issued_early": issued, "buckets": len(model._grads.reduction.buckets)}


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
            assert model._grads.reduction.issued() == len(model._grads.reduction.buckets)
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


# ---- per stage under pipeline parallelism (reduction.py: arm_counted) -----------------------


def _pp_worker(name: str, variants: list[str], passes: int = 1) -> dict:
    """pp 2 x dp 2, 2 microbatches, an unmodified HF model with its default config; replica r
    trains on ``_rank_batch(r, step)`` (its own lengths, padding on replica 1 only) and the
    reference on both. Per step, ``variants``: "once" (one forward per microbatch), "twice" (two
    forwards, the second on the sequences reversed, the mean of both losses: twice the
    accumulations on every stage), "fail" (replica
    1's leader raises before the last microbatch's backward; its peers' buckets are out).
    With ``passes`` > 1 (``backward_passes_per_step``) gradients are compared, and the counts
    recorded, at the end of each window."""
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True})
    replica, stage = smp.dp_rank(), smp.pp_rank()
    torch.manual_seed(0)
    reference = tiny_hf_model(name)
    torch.manual_seed(0)
    model = smp.DistributedModel(
        tiny_hf_model(name), bucket_cap_mb=SMALL_BUCKETS_MB, backward_passes_per_step=passes
    )
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("smp").addHandler(handler)
    variant = ["once"]

    @smp.step
    def train_step(model, ids, mask):
        loss = _llama_loss(model, ids, mask)
        if variant[0] == "twice":
            loss = (loss + _llama_loss(model, ids.flip(1), mask.flip(1))) / 2
        if variant[0] == "fail" and replica == 1 and smp.microbatch() == 1:
            raise KeyError("boom before the last backward")
        model.backward(loss)
        return loss

    result: dict = {"issued_early": [], "first_issue_at": [], "accumulations": [], "error": None}
    marks: list[int] = []  # accumulations counted on this stage when each bucket went out
    for step, variant[0] in enumerate(variants):
        reduction = model._grads.reduction
        if reduction is not None and not hasattr(reduction, "_test_issue"):
            reduction._test_issue = reduction._issue

            def issue(bucket, reduction=reduction):
                marks.append(sum(reduction._counts.values()))
                reduction._test_issue(bucket)

            reduction._issue = issue
        ids, mask = _rank_batch(replica, step)
        if variant[0] == "fail":
            before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            start = time.monotonic()
            with pytest.raises(Exception) as info:
                train_step(model, ids, mask)
            result["seconds"] = time.monotonic() - start
            result["error"] = f"{type(info.value).__name__}: {info.value}"
            after = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert list(after) == list(before)
            for n, grad in before.items():
                torch.testing.assert_close(after[n], grad, rtol=0, atol=0)
            continue
        if step % passes == 0:
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
            marks.clear()
        loss = train_step(model, ids, mask).reduce_mean().item()
        reference_loss = 0.0
        for r in range(2):  # the global batch: every replica's microbatches, each its own mean
            r_ids, r_mask = _rank_batch(r, step)
            for i, m in zip(r_ids.chunk(2), r_mask.chunk(2)):
                part = _llama_loss(reference, i, m) / 4
                if variant[0] == "twice":
                    part = (part + _llama_loss(reference, i.flip(1), m.flip(1)) / 4) / 2
                part.backward()
                if r == replica:
                    reference_loss += part.item() * 2
        assert abs(loss - reference_loss) < 1e-5, (step, loss, reference_loss)
        if step % passes != passes - 1:
            continue
        assert_owned_grads_match(model, reference, stage, TOL)
        optimizer.step()
        reference_optimizer.step()
        for (n, p), (_, q) in zip(model.module.named_parameters(), reference.named_parameters()):
            if model._owns(n):
                torch.testing.assert_close(p, q, **TOL, msg=lambda m, n=n: f"{n}: {m}")
        reduction = model._grads.reduction
        result["issued_early"].append(reduction.issued_early)
        result["first_issue_at"].append(marks[0] if marks else None)
        result["accumulations"].append(sum(reduction._expected.values()))
    logging.getLogger("smp").removeHandler(handler)
    local = [p for p in model.local_parameters() if p.requires_grad]
    result["buckets"] = len(reduction.buckets)
    result["planned"] = sorted(id(p) for b in reduction.buckets for p in b.params)
    result["local"] = sorted(id(p) for p in local)
    result["stage"] = stage
    result["reduced_again"] = sum("reduced again" in r for r in records)
    return result


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_per_stage_under_pipeline_with_different_data_per_replica(pools, name):
    """Each stage's buckets go out during its backward from the second step on, the first of
    them well before the stage's last accumulation; only the stage's own parameters are in its
    plan; GPT-2's tied embedding (two accumulations per microbatch on its stage) is counted.
    A step whose structure changes (two forwards) is caught and reduced again, the one after it
    is issued at the end, and the one after that overlaps again: exact throughout."""
    variants = ["once", "once", "twice", "once", "once"]
    results = pools.run(4, _pp_worker, name, variants)
    assert sorted(r["stage"] for r in results) == [0, 0, 1, 1]
    for r in results:
        assert r["planned"] == r["local"], "a stage's plan holds exactly its own parameters"
        assert r["buckets"] > 5, r["buckets"]
        early = r["issued_early"]
        assert early[0] == 0 and early[1] == r["buckets"] and early[4] == r["buckets"], r
        assert early[2] > 0 and early[3] == 0, r  # stale (some went early), then late
        assert r["reduced_again"] == 1, r
        # Overlapped: the first bucket left before the stage's last accumulation (a bucket goes
        # out when the engine call that made it final returns: one per interval of a worker).
        for step in (1, 4):
            assert r["first_issue_at"][step] < r["accumulations"][step], r
        assert r["accumulations"][2] == 2 * r["accumulations"][1], r


def test_per_stage_failure_after_buckets_went_out_on_the_other_replica(pools):
    results = pools.run(4, _pp_worker, "llama", ["once", "once", "fail", "once"])
    for r in results:
        assert r["error"] is not None and "boom" in r["error"], r["error"]
        assert r["seconds"] < 10, r
        assert r["issued_early"] == [0, r["buckets"], r["buckets"]], r


def test_per_stage_under_pipeline_with_backward_passes_per_step(pools):
    """Two backward passes per step: each stage's buckets go out during the window's last step
    (its counts learned from the first window's), with the sum of both passes."""
    results = pools.run(4, _pp_worker, "llama", ["once"] * 6, 2)
    for r in results:
        assert r["issued_early"] == [0, r["buckets"], r["buckets"]], r
        assert all(at < n for at, n in zip(r["first_issue_at"][1:], r["accumulations"][1:])), r

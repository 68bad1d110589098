"""TP ranks whose arguments differ never stall: they run each rank's arguments in turn, or fail
fast on every rank with the cause (smp/tp/agreement.py, design.md §6.3).

With smp's batch semantics each TP rank brings its own samples. Real batches differ between
ranks: Hugging Face passes ``attention_mask=None`` into its blocks for a batch without padding
(a mask for one with padding), and lengths differ. Unmodified Hugging Face BERT, Llama and GPT-2
(tiny configs, defaults otherwise: GPT-2 and Llama keep ``use_cache=True``, so a key/value cache
reaches every block) train at tp = 2 and tp = 2 x dp = 2 with
  - "pad_one": padding on TP rank 0 only (TP rank 1's all-ones mask becomes None inside HF),
  - "none_one": ``attention_mask`` on TP rank 0, none at all on TP rank 1,
  - "lengths": another sequence length on every rank,
and match a single-process reference every step: the loss, every gradient (gathered to its full
shape), and the full ``state_dict`` after each of 3 AdamW steps (lr 1e-3, eps 1e-6; fp32 at
rtol 2e-4, atol 2e-5). GPT-2 does the same at pp = 2 x tp = 2 with 2 microbatches.

The reference's objective is smp's: the mean over data-parallel ranks (TP ranks included) of
each rank's Hugging Face loss on its own samples. Where the ranks' sequences have one length the
reference runs the global batch in ONE forward (every rank's samples, with a mask of ones for a
rank that passed none) and takes each rank's loss from its slice of the logits, as
test_tp_parity.py does: that also checks that these models' per-sample results do not depend on
the rest of the batch (with or without a padding mask elsewhere; they do not, up to the kernel's
rounding). Where lengths differ, the global batch is not one tensor, and the reference runs each
rank's samples in its own forward.

A fuzz test draws per-rank lengths, masks (padding, all ones, none) and keyword arguments
present on some ranks only from a fixed seed: each case matches the reference, or, where a rank
passes ``use_cache=False`` and its peer keeps the cache (an object smp cannot send), fails fast on
every rank naming the module and the cache. smp's own ``DistributedTransformerLMHead`` (its own
region entry) is checked with lengths, masks and labels that differ; the agreement's collectives
are counted, and ranks in different modules fail fast naming both.

smp's ``timeout_s`` is 20 s in these tests, and every step must finish within 10 s, so a
regression fails fast instead of hanging (before the agreement existed these cases waited the
whole ``timeout_s`` in a gloo collective, or a process aborted on a size mismatch).
"""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch
import torch.nn.functional as F
from models import parity_adamw, tiny_hf_model
from test_tp_parity import LM, full_grads, local_group

SEQ = 8
VOCAB = 64
LOCAL_BATCH = 2
STEPS = 3
TOL = dict(rtol=2e-4, atol=2e-5)
TIMEOUT_S = 20
FAST_S = 10.0  # a divergence that cannot run must fail within this, far below TIMEOUT_S
BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer"}


def _distributed(smp, kind: str):
    """(the model under smp with its blocks split over the TP group, the reference)."""
    torch.manual_seed(5)
    reference = tiny_hf_model(kind, VOCAB, SEQ)
    model = copy.deepcopy(reference)
    for block in model.get_submodule(BLOCKS[kind]):
        smp.set_tensor_parallelism(block)
    model = smp.DistributedModel(model)
    assert len(model.distributed_modules) == 2, model.distributed_modules
    return model, reference


def _batch(kind: str, seed: int, seq: int, mask: str, extra: tuple = ()) -> dict:
    """One rank's samples as keyword arguments of the model. ``mask``: "pad" (padding at the end
    of every sample but the first), "ones" or "none" (no attention_mask argument). ``extra``:
    "position_ids" (passed explicitly, [B, S]), "no_cache" (``use_cache=False``),
    "token_type_ids" (BERT: zeros)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (LOCAL_BATCH, seq), generator=g)
    ones = torch.ones_like(ids)
    if mask == "pad":
        for i in range(1, LOCAL_BATCH):
            ones[i, seq - 1 - i % (seq - 2) :] = 0
    batch = {"input_ids": ids}
    if mask != "none":
        batch["attention_mask"] = ones
    if kind == "bert":
        batch["labels"] = torch.randint(0, 3, (LOCAL_BATCH,), generator=g)
    else:
        batch["labels"] = torch.where(ones.bool(), ids, torch.full_like(ids, -100))
    if "position_ids" in extra:
        batch["position_ids"] = torch.arange(seq).expand(LOCAL_BATCH, seq).contiguous()
    if "no_cache" in extra:
        batch["use_cache"] = False
    if "token_type_ids" in extra:
        batch["token_type_ids"] = torch.zeros_like(ids)
    return batch


def _loss_of_logits(kind: str, model, logits: torch.Tensor, labels: torch.Tensor):
    """The loss Hugging Face computes from ``logits`` and ``labels`` (mean over this batch)."""
    if kind == "bert":  # single-label classification: CrossEntropyLoss
        return F.cross_entropy(logits.view(-1, 3), labels.view(-1))
    return model.loss_function(logits=logits, labels=labels, vocab_size=VOCAB)


def _reference_objective(kind: str, reference, batches: list[dict]) -> torch.Tensor:
    """smp's objective on one process: the mean over ranks of each rank's loss."""
    shapes = {b["input_ids"].shape for b in batches}
    plain = all(set(b) <= {"input_ids", "attention_mask", "labels"} for b in batches)
    if len(shapes) == 1 and plain:  # one forward of the global batch
        ids = torch.cat([b["input_ids"] for b in batches])
        mask = torch.cat(
            [b.get("attention_mask", torch.ones_like(b["input_ids"])) for b in batches]
        )
        logits = reference(input_ids=ids, attention_mask=mask).logits
        losses = [
            _loss_of_logits(kind, reference, part, b["labels"])
            for part, b in zip(logits.split([len(b["input_ids"]) for b in batches]), batches)
        ]
    else:  # one forward per rank's samples
        losses = [reference(**b).loss for b in batches]
    return sum(losses) / len(losses)


class _CountRunsInTurn:
    """Counts the regions that ran each rank's arguments in turn (the agreement's slow path)."""

    def __enter__(self):
        from smp.tp import region

        self.count, self._original = 0, region._run_in_turn

        def counted(*args, **kwargs):
            self.count += 1
            return self._original(*args, **kwargs)

        region._run_in_turn = counted
        return self

    def __exit__(self, *exc):
        from smp.tp import region

        region._run_in_turn = self._original


def _layout(smp) -> list[tuple[int, int]]:
    """(tp rank, rdp rank) of every data-parallel index (the ranks that bring their own samples)."""
    return smp.allgather((smp.tp_rank(), smp.rdp_rank()), smp.DP_GROUP)


def _case_batches(kind: str, case: str, step: int, layout) -> list[dict]:
    """Every rank's samples in ``case``: one dict per data-parallel index, the same on all ranks."""
    out = []
    for index, (tp, rdp) in enumerate(layout):
        seed = 1000 * step + 10 * index + 1
        if case == "pad_one":
            out.append(_batch(kind, seed, SEQ, "pad" if tp == 0 else "ones"))
        elif case == "none_one":
            out.append(_batch(kind, seed, SEQ, "pad" if tp == 0 else "none"))
        else:  # lengths: 8, 6 in the first TP group, 7, 5 in the second
            out.append(_batch(kind, seed, SEQ - 2 * tp - rdp, "ones"))
    return out


def _compare(smp, model, reference, loss: float, reference_loss: torch.Tensor, what: str):
    global_loss = sum(smp.allgather(loss, smp.DP_GROUP)) / smp.dp_size()
    expected = reference_loss.item()
    assert abs(global_loss - expected) <= TOL["atol"] + TOL["rtol"] * abs(expected), (
        what, global_loss, expected,
    )  # fmt: skip
    grads = full_grads(model)
    for name, q in reference.named_parameters():
        if name not in grads:  # another pipeline stage's
            continue
        want = q.grad if q.grad is not None else torch.zeros_like(q)
        torch.testing.assert_close(
            grads[name], want, **TOL, msg=lambda m, n=name: f"{what}: gradient of {n}: {m}"
        )
    return global_loss


def _microbatches(batch: dict, microbatches: int) -> list[dict]:
    """``batch`` as smp.step splits it: every tensor along dim 0."""
    return [
        {
            k: v.chunk(microbatches)[i] if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
        }
        for i in range(microbatches)
    ]


def _parity_worker(kind: str, tp: int, pp: int = 1, microbatches: int = 1) -> dict:
    import smp

    smp.init(
        {"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp,
         "microbatches": microbatches, "timeout_s": TIMEOUT_S}
    )  # fmt: skip
    layout = _layout(smp)
    results = {}
    for case in ("pad_one", "none_one", "lengths"):
        model, reference = _distributed(smp, kind)
        optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
        reference_optimizer = parity_adamw(reference.parameters())

        @smp.step
        def train_step(model, batch):
            loss = model(**batch).loss
            model.backward(loss)
            return loss

        losses = []
        for step in range(STEPS):
            batches = _case_batches(kind, case, step, layout)
            optimizer.zero_grad()
            start = time.monotonic()
            with _CountRunsInTurn() as runs:
                loss = train_step(model, batches[smp.dp_rank()]).reduce_mean().item()
            assert time.monotonic() - start < FAST_S, (case, step, time.monotonic() - start)
            # The blocks' arguments differed: both ran in turn (with microbatches or stages, at
            # least one on each rank: a microbatch whose samples have no padding agrees).
            assert runs.count == 2 if pp * microbatches == 1 else runs.count > 0, runs.count
            reference_optimizer.zero_grad()
            pieces = [mb for b in batches for mb in _microbatches(b, microbatches)]
            objective = _reference_objective(kind, reference, pieces)
            objective.backward()
            losses.append(_compare(smp, model, reference, loss, objective, f"{case} step {step}"))
            optimizer.step()
            reference_optimizer.step()
            full = model.state_dict()
            for name, q in reference.state_dict().items():
                torch.testing.assert_close(
                    full[name], q, **TOL, msg=lambda m, n=name, s=step, c=case: f"{c} {s} {n}: {m}"
                )
        results[case] = losses
    return results


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("world", [2, 4])  # tp = 2, and tp = 2 x dp = 2
def test_hugging_face_divergent_ranks_match_reference(pools, kind, world):
    pytest.importorskip("transformers")
    results = pools.run(world, _parity_worker, kind, 2, timeout_s=150)
    assert all(r == results[0] for r in results)


def test_pipeline_tp_divergent_ranks_match_reference(pools):
    """pp = 2 x tp = 2 with 2 microbatches: the TP ranks of each stage run the stage's tasks in
    one order (design.md §6.4), and each task's regions agree or run in turn."""
    pytest.importorskip("transformers")
    results = pools.run(4, _parity_worker, "gpt2", 2, 2, 2, timeout_s=150)
    assert all(r == results[0] for r in results)


# ---- fuzz ---------------------------------------------------------------------------------------


def _fuzz_cases(
    num_cases: int, ranks_per_case: int = 2, seed: int = 1235
) -> list[tuple[str, list[tuple]]]:
    """(model kind, per data-parallel index: (sequence length, mask kind, extra arguments)),
    from a fixed seed. Every case has ranks that differ somewhere."""
    rng = random.Random(seed + ranks_per_case - 2)
    cases = []
    while len(cases) < num_cases:
        kind = ("gpt2", "llama", "bert")[len(cases) % 3]
        extras = (
            {"position_ids": 0.3, "no_cache": 0.1} if kind != "bert" else {"token_type_ids": 0.3}
        )
        ranks = [
            (
                rng.choice([4, 6, SEQ]),
                rng.choice(["pad", "ones", "none"]),
                tuple(e for e, p in extras.items() if rng.random() < p),
            )
            for _ in range(ranks_per_case)
        ]
        if any(r != ranks[0] for r in ranks):
            cases.append((kind, ranks))
    return cases


def _fuzz_worker(num_cases: int, pp: int = 1) -> list[tuple]:
    """The fuzz cases at tp 2 (x dp when the world is larger, x pp stages): each rank brings
    the samples of its data-parallel index."""
    import smp

    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": pp, "timeout_s": TIMEOUT_S})
    layout = _layout(smp)  # (tp rank, rdp rank) of every data-parallel index
    models = {kind: _distributed(smp, kind) for kind in ("gpt2", "llama", "bert")}

    @smp.step
    def train_step(model, batch):
        loss = model(**batch).loss
        model.backward(loss)
        return loss

    report = []
    for number, (kind, ranks) in enumerate(_fuzz_cases(num_cases, smp.dp_size())):
        model, reference = models[kind]
        batches = [
            _batch(kind, 100 * number + r, seq, mask, extra)
            for r, (seq, mask, extra) in enumerate(ranks)
        ]
        # A key/value cache on some ranks of a TP group only cannot run in turn (smp cannot
        # send one): that must fail fast on every rank, naming it. Everything else must match.
        groups: dict[int, set] = {}
        for (_, rdp), (_, _, extra) in zip(layout, ranks):
            groups.setdefault(rdp, set()).add("no_cache" in extra)
        must_fail = kind != "bert" and any(len(caches) > 1 for caches in groups.values())
        model.zero_grad()
        start = time.monotonic()
        try:
            with _CountRunsInTurn() as runs:
                loss = train_step(model, batches[smp.dp_rank()]).reduce_mean().item()
        except (smp.DivergentArgumentsError, smp.StepFailedError) as exc:
            seconds = time.monotonic() - start
            assert must_fail, (number, kind, ranks, str(exc)[:3000])
            assert seconds < FAST_S, (number, seconds)
            message = str(exc)
            assert "cannot run together" in message and BLOCKS[kind] in message, message
            assert "DynamicCache" in message and "None" in message, message
            report.append((number, "failed fast", None))
            continue
        assert not must_fail, (number, kind, ranks)
        assert time.monotonic() - start < FAST_S, (number, time.monotonic() - start)
        reference.zero_grad()
        objective = _reference_objective(kind, reference, batches)
        objective.backward()
        what = f"case {number} {kind} {ranks}"
        global_loss = _compare(smp, model, reference, loss, objective, what)
        # The path is this rank's: with data parallelism one TP group may agree, another not.
        path = "in turn" if runs.count else "agreed"
        report.append((number, f"matched ({path})", round(global_loss, 6)))
    return report


@pytest.mark.parametrize(
    "world, pp, cases",
    [(2, 1, 12), (4, 1, 6), (4, 2, 6)],
    ids=["tp2", "tp2xdp2", "pp2xtp2"],
)
def test_fuzz_divergent_arguments_match_or_fail_fast(pools, world, pp, cases):
    pytest.importorskip("transformers")
    results = pools.run(world, _fuzz_worker, cases, pp, timeout_s=150)

    def outcome(case):  # what every rank must agree on: failed, or matched with this loss
        return case[0], case[1].partition(" ")[0], case[2]

    assert all([outcome(c) for c in r] == [outcome(c) for c in results[0]] for r in results)
    outcomes = {c[1] for r in results for c in r}
    assert "matched (in turn)" in outcomes, results
    if world == 2:
        assert "failed fast" in outcomes, results[0]
    print(*results[0], sep="\n")


# ---- smp's own modules --------------------------------------------------------------------------


def _lm_head_worker(optimize: str) -> list[float]:
    """DistributedTransformerLMHead (its own region entry) with other lengths per rank, a mask
    on one rank only, and labels on one rank only."""
    import smp
    from smp.nn import DistributedTransformerLMHead

    smp.init({"tensor_parallel_degree": 2, "optimize": optimize, "timeout_s": TIMEOUT_S})
    config = dict(LM, causal_mask_size=None)
    torch.manual_seed(11)
    reference = DistributedTransformerLMHead(**config, group=local_group())
    model = smp.DistributedModel(DistributedTransformerLMHead(**config))
    model.load_state_dict(reference.state_dict())

    def inputs(rank: int):
        g = torch.Generator().manual_seed(rank)
        seq = SEQ - 3 * rank
        ids = torch.randint(0, LM["vocab_size"], (LOCAL_BATCH, seq), generator=g)
        mask = None
        if rank == 0:  # additive padding mask [B, 1, 1, S]
            mask = torch.zeros(LOCAL_BATCH, 1, 1, seq)
            mask[1, ..., -2:] = torch.finfo(mask.dtype).min
        return ids, mask

    def loss_of(m, rank: int):
        ids, mask = inputs(rank)
        if rank == 0:  # labels: the loss per token
            return m(ids, mask, labels=ids.roll(-1, 1)).mean()
        return m(ids, mask).logsumexp(-1).mean()  # no labels: the logits

    @smp.step
    def train_step(model):
        loss = loss_of(model, smp.tp_rank())
        model.backward(loss)
        return loss

    start = time.monotonic()
    loss = train_step(model).reduce_mean().item()
    assert time.monotonic() - start < FAST_S
    objective = (loss_of(reference, 0) + loss_of(reference, 1)) / 2
    objective.backward()
    return [_compare(smp, model, reference, loss, objective, f"lm head {optimize}")]


@pytest.mark.parametrize("optimize", ["speed", "memory"])
def test_smp_lm_head_divergent_ranks_match_reference(pools, optimize):
    results = pools.run(2, _lm_head_worker, optimize, timeout_s=150)
    assert results[0] == results[1]


# ---- the agreement itself -----------------------------------------------------------------------


def _agreement_worker() -> dict:
    """The agreement's collectives, counted: one all-gather of 16 bytes per rank when the ranks
    agree; with prescaled_batch none at all. And a region whose ranks are in different modules
    fails on every rank, fast, naming both."""
    import smp
    from smp import _C
    from smp.nn import DistributedLinear
    from smp.tp.region import DivergentArgumentsError

    out = {}
    for prescaled in (False, True):
        smp.init({"tensor_parallel_degree": 2, "prescaled_batch": prescaled, "timeout_s": 20})
        counting = _C.CountingGroup(smp.get_tp_process_group())
        torch.manual_seed(0)
        layer = DistributedLinear(8, 8, split="column", group=counting.group)
        x = torch.randn(2, 8)
        counting.reset()
        layer(x)
        out[prescaled] = counting.counts()
        smp.shutdown()
    smp.init({"tensor_parallel_degree": 2, "timeout_s": 20})
    first, second = DistributedLinear(8, 8), DistributedLinear(8, 8)
    first._smp_region_name, second._smp_region_name = "first", "second"
    start = time.monotonic()
    try:
        (first if smp.tp_rank() == 0 else second)(torch.randn(2, 8))
    except DivergentArgumentsError as exc:
        out["error"] = (str(exc), time.monotonic() - start)
    return out


def test_agreement_cost_and_different_regions(pools):
    x_bytes = 2 * 8 * 4  # x: [2, 8] fp32 on each rank
    for r, result in enumerate(pools.run(2, _agreement_worker, timeout_s=120)):
        # Agreed: the 16-byte digest, then the region's own all-gathers: the batch at entry and
        # the column-parallel output ([4, 4] per rank); the exit keeps this rank's rows.
        assert result[False] == {"_allgather_base": (3, 16 + x_bytes + x_bytes)}, result
        # prescaled_batch: no agreement, only the output's all-gather ([2, 4] per rank).
        assert result[True] == {"_allgather_base": (1, x_bytes // 2)}, result
        message, seconds = result["error"]
        assert "TP rank 0 in first, TP rank 1 in second" in message, message
        assert f"this is TP rank {r}" in message and seconds < FAST_S, (message, seconds)


def test_description_names_the_difference():
    """The phrase every message uses for what differs between two ranks (no processes)."""
    from smp.tp.agreement import _Call, _describe_difference

    block = torch.nn.Identity()  # only its name is read
    hidden = torch.zeros(2, 8, 32, requires_grad=True)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)

    def spec(h, m):
        return _Call.describe(block, (h,), {"attention_mask": m, "use_cache": True}).spec

    a, b, c = spec(hidden, mask), spec(hidden, None), spec(hidden[:, :5], None)
    assert _describe_difference([a, b], 0, 1) == (
        "attention_mask is a bool tensor of shape [2, 1, 8, 8] on TP rank 0 and None on TP rank 1"
    )
    assert _describe_difference([b, c], 0, 1) == (
        "argument 0 is a float32 tensor of shape [2, 8, 32] requiring grad on TP rank 0 and a "
        "float32 tensor of shape [2, 5, 32] requiring grad on TP rank 1"
    )
    # Equal calls describe equally, whatever the values: the digests match.
    other = torch.ones(2, 8, 32, requires_grad=True)
    assert repr(spec(other, mask.clone())) == repr(a)
    assert _Call.describe(block, (other,), {}).digest().shape == (2,)

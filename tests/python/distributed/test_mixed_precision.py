"""bf16 mixed precision (``"bf16": True``): the step's forward runs under ``torch.autocast`` to
bfloat16 on every stage, the parameters, gradients and reductions stay in float32.

Against one process running the same global batches under ``torch.autocast(dtype=bfloat16)``:
the demo GPT at pp 2 x tp 2 and an unmodified Hugging Face Llama at pp 2 x tp 2 (whole model
marked), every rank with its own samples. Checked: the loss of every step, every gradient and
the parameters after SGD steps, to bfloat16's tolerance, and that the projections of both stages
computed in bfloat16. And over 100 AdamW steps on a learnable sequence, bf16 and fp16 (static
loss scale) on both models: every loss within 1 % of one process under autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import build_model, loss_fn, make_batch, split_gpt_blocks, tiny_hf_model
from test_tp_parity import full_grads

STEPS = 3
TOL = dict(rtol=3e-2, atol=3e-3)  # bfloat16 keeps 8 bits of mantissa


def _batches(kind: str, step: int, replica: int):
    if kind == "gpt":
        return make_batch("gpt", 4, step, seed=50 + replica)
    g = torch.Generator().manual_seed(1000 * replica + step)
    ids = [torch.randint(0, 64, (4,), generator=g)]  # x[t+1] = 5 x[t] + 3 mod 64: learnable
    for _ in range(7):
        ids.append((5 * ids[-1] + 3) % 64)
    ids = torch.stack(ids, 1)
    return ids, ids


def _loss(kind: str, model, ids, labels):
    if kind == "gpt":
        return loss_fn("gpt", model(ids), labels)
    return model(input_ids=ids, labels=labels)["loss"]


def _worker(kind: str):
    import smp

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
              "bf16": True})  # fmt: skip
    torch.manual_seed(0)
    if kind == "gpt":
        reference = build_model("gpt")
        module = copy.deepcopy(reference)
        split_gpt_blocks(smp, module)
    else:
        reference = tiny_hf_model("llama", 64, 8, use_cache=False)
        module = copy.deepcopy(reference)
        smp.set_tensor_parallelism(module)
    model = smp.DistributedModel(module)
    dtypes: set[torch.dtype] = set()

    def record(_module, _args, output):
        if isinstance(output, torch.Tensor):
            dtypes.add(output.dtype)

    for sub in model.module.modules():
        if "Linear" in type(sub).__name__:
            sub.register_forward_hook(record)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)

    @smp.step
    def train_step(model, ids, labels):
        loss = _loss(kind, model, ids, labels)
        model.backward(loss)
        return loss

    replicas = smp.dp_size()  # the TP ranks of a stage bring their own samples
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = train_step(model, *_batches(kind, step, smp.dp_rank())).reduce_mean()
        loss = sum(smp.allgather(loss.item(), smp.DP_GROUP)) / replicas
        reference_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = sum(
                _loss(kind, reference, *_batches(kind, step, r)) for r in range(replicas)
            )
        (expected / replicas).backward()
        assert abs(loss - expected.item() / replicas) <= 3e-2 * abs(loss), (step, loss, expected)
        grads = full_grads(model)
        for name, q in reference.named_parameters():
            if name in grads and q.grad is not None:
                torch.testing.assert_close(grads[name], q.grad, **TOL, msg=lambda m, n=name: n + m)
        optimizer.step()
        reference_optimizer.step()
        losses.append(loss)
    full = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, **TOL, msg=lambda m, n=name: n + m)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the master weights
    return sorted(str(d) for d in dtypes), losses


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_bf16_pp2_tp2_matches_one_process_under_autocast(pools, kind):
    for dtypes, losses in pools.run(4, _worker, kind, timeout_s=300):
        assert dtypes == ["torch.bfloat16"], dtypes  # every projection, on both stages
        assert losses[-1] < losses[0], losses


def _fp16_worker():
    """fp16 with a static loss scale against one process under autocast to float16 with the
    same scale, then an inf injected on one rank with a dynamic scale."""
    import smp

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
              "fp16": True})  # fmt: skip
    torch.manual_seed(0)
    reference = build_model("gpt")
    module = copy.deepcopy(reference)
    split_gpt_blocks(smp, module)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), static_loss_scale=1024.0
    )
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)

    @smp.step
    def train_step(model, ids, labels):
        loss = _loss("gpt", model, ids, labels)
        model.backward(loss)
        return loss

    replicas = smp.dp_size()
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = train_step(model, *_batches("gpt", step, smp.dp_rank())).reduce_mean()
        loss = sum(smp.allgather(loss.item(), smp.DP_GROUP)) / replicas
        grads = full_grads(model)  # still scaled: the optimizer unscales them
        reference_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            expected = sum(_loss("gpt", reference, *_batches("gpt", step, r)) for r in range(2))
        (expected / replicas * 1024.0).backward()
        for q in reference.parameters():
            q.grad /= 1024.0
        assert abs(loss - expected.item() / replicas) <= 1e-2 * abs(loss), (step, loss, expected)
        for name, q in reference.named_parameters():
            if name in grads:
                torch.testing.assert_close(grads[name] / 1024.0, q.grad, **TOL, msg=name)
        optimizer.step()
        reference_optimizer.step()
    full = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, **TOL, msg=lambda m, n=name: n + m)

    # A dynamic scale; an inf on one rank only: every rank skips the step and lowers the scale.
    optimizer = smp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**10, "scale_window": 2},
    )
    scales, skipped = [], []
    for step in range(4):
        optimizer.zero_grad()
        train_step(model, *_batches("gpt", step, smp.dp_rank()))
        if step == 1 and smp.rank() == 3:
            grad = next(p.grad for p in model.local_parameters() if p.grad is not None)
            grad.view(-1)[0] = float("inf")
        before = {n: p.detach().clone() for n, p in model.local_named_parameters()}
        result = optimizer.step()
        after = dict(model.local_named_parameters())
        skipped.append(result is None and all(torch.equal(after[n], v) for n, v in before.items()))
        scales.append(optimizer.loss_scale)

    # The loss scale is part of the optimizer's state dicts (partial and full): a resumed run
    # goes on with the same scale and the same count of good steps.
    scaler = optimizer._smp_scaler
    for saved in (optimizer.local_state_dict(), optimizer.state_dict()):
        fresh = smp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5), dynamic_loss_scale=True
        )
        assert fresh.loss_scale == 2.0**32  # v1's initial scale
        fresh.load_state_dict(saved)
        assert fresh._smp_scaler.state_dict() == scaler.state_dict()
        assert smp.state.get_state().loss_scale == scaler.scale  # what model.backward applies
    return skipped, scales


def test_fp16_loss_scaling_and_a_skipped_step(pools):
    for skipped, scales in pools.run(4, _fp16_worker, timeout_s=300):
        assert skipped == [False, True, False, False], skipped  # on every rank
        # 1024 -> overflow halves it -> 2 good steps double it
        assert scales == [1024.0, 512.0, 512.0, 1024.0], scales


def _grad_scaler_worker():
    """A script that scales its losses itself with smp.amp.GradScaler, at pp 2: an inf in one
    stage's gradients skips the step on both stages and lowers the scale on both."""
    import smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    module = build_model("gpt")
    split_gpt_blocks(smp, module)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    scaler = smp.amp.GradScaler(init_scale=256.0, growth_interval=2)

    @smp.step
    def train_step(model, ids, labels):
        loss = _loss("gpt", model, ids, labels)
        model.backward(scaler.scale(loss))
        return loss

    skipped, scales = [], []
    for step in range(4):
        optimizer.zero_grad()
        train_step(model, *_batches("gpt", step, 0))
        if step == 1 and smp.pp_rank() == 1:
            grad = next(p.grad for p in model.local_parameters() if p.grad is not None)
            grad.view(-1)[0] = float("nan")
        before = {n: p.detach().clone() for n, p in model.local_named_parameters()}
        scaler.step(optimizer)
        scaler.update()
        after = dict(model.local_named_parameters())
        skipped.append(all(torch.equal(after[n], v) for n, v in before.items()))
        scales.append(scaler.get_scale())
    return skipped, scales


def test_smp_grad_scaler_agrees_on_overflow_across_stages(pools):
    for skipped, scales in pools.run(2, _grad_scaler_worker, timeout_s=300):
        assert skipped == [False, True, False, False], skipped
        assert scales == [256.0, 128.0, 128.0, 256.0], scales


CURVE_STEPS = 100


def _curve_batch(kind: str, step: int, replica: int):
    """A learnable sequence (x[t+1] = 5 x[t] + 3 mod 64) from a random start per sample: the
    curve falls, so a wrong step shows."""
    g = torch.Generator().manual_seed(7000 + 100 * replica + step)
    ids = [torch.randint(0, 64, (4,), generator=g)]
    for _ in range(16):
        ids.append((5 * ids[-1] + 3) % 64)
    ids = torch.stack(ids, 1)
    if kind == "gpt":
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return ids[:, :8], ids[:, :8]


def _curve_worker(kind: str, precision: str):
    """100 AdamW steps at pp 2 x tp 2 in ``precision``; every step's loss (the mean over the
    data-parallel ranks, which each bring their own samples)."""
    import smp

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
              precision: True})  # fmt: skip
    torch.manual_seed(0)
    if kind == "gpt":
        module = build_model("gpt")
        split_gpt_blocks(smp, module)
    else:
        module = tiny_hf_model("llama", 64, 8, use_cache=False)
        smp.set_tensor_parallelism(module)
    model = smp.DistributedModel(module)
    scaling = {"static_loss_scale": 1024.0} if precision == "fp16" else {}
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), **scaling)

    @smp.step
    def train_step(model, ids, labels):
        loss = _loss(kind, model, ids, labels)
        model.backward(loss)
        return loss

    losses = []
    for step in range(CURVE_STEPS):
        optimizer.zero_grad()
        loss = train_step(model, *_curve_batch(kind, step, smp.dp_rank())).reduce_mean()
        losses.append(sum(smp.allgather(loss.item(), smp.DP_GROUP)) / smp.dp_size())
        optimizer.step()
    return losses


def _curve_reference(kind: str, dtype: torch.dtype) -> list[float]:
    torch.manual_seed(0)
    model = build_model("gpt") if kind == "gpt" else tiny_hf_model("llama", 64, 8, use_cache=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scale = 1024.0 if dtype == torch.float16 else 1.0
    losses = []
    for step in range(CURVE_STEPS):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = sum(_loss(kind, model, *_curve_batch(kind, step, r)) for r in range(2)) / 2
        (loss * scale).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= scale
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "kind,precision", [("gpt", "bf16"), ("llama", "bf16"), ("gpt", "fp16"), ("llama", "fp16")]
)
def test_loss_curve_over_100_steps_within_1_percent_of_one_process(pools, kind, precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    expected = _curve_reference(kind, dtype)
    losses = pools.run(4, _curve_worker, kind, precision, timeout_s=600)[0]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True))
    assert worst <= 0.01, (worst, losses[::10], expected[::10])
    assert expected[-1] < 0.5 * expected[0]  # a curve that learns, not a flat line

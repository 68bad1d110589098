"""smp's parallel layouts with CUDA tensors, against one process on the same GPU.

With one GPU, 2 and 4 processes share it through gloo (``"backend": "gloo", "device":
"cuda"``; NCCL refuses two ranks on one device): pp 2, tp 2 and pp 2 x tp 2 on an unmodified
Hugging Face Llama marked whole inside ``smp.tensor_parallelism()``, each rank given different
data with padding on some samples only. Every rank checks where things live (its owned
parameters on its GPU, the others released, the step's results on its GPU) and the loss, the
full state dict after each of three AdamW steps, against the reference. With two GPUs or more,
the pipeline runs on NCCL as well, launched by torchrun (``nccl_pipeline_script.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import parity_adamw, tiny_hf_model

pytest.importorskip("transformers")

VOCAB, SEQ, STEPS = 64, 8, 3
TOL = dict(rtol=1e-4, atol=1e-5)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (CPU; smp moves each rank's part to its device), and its
    attention mask: padding on the samples whose first token is small, so on some ranks
    only."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[ids[:, 0] < VOCAB // 3, -3:] = 0
    return ids, mask


def assert_same_state(model, reference) -> None:
    """The wrapped model's full state dict (gathered over the stages) equals the reference's."""
    full = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(
            full[name].cpu(), value.cpu(), **TOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def _layout_worker(
    pp: int, tp: int, microbatches: int, device_kind: str = "cuda", keep_min: int | None = None
):
    """``keep_min``: the size from which a request tensor the owner did not read stays with
    the caller (0: every one; Note [Arguments fetched when read] in smp.pipeline.calls)."""
    from smp.pipeline import calls

    keep = calls._KEEP_MIN
    calls._KEEP_MIN = keep if keep_min is None else keep_min
    try:
        return _layout(pp, tp, microbatches, device_kind)
    finally:
        calls._KEEP_MIN = keep


def _layout(pp: int, tp: int, microbatches: int, device_kind: str):
    import smp

    smp.init(
        {
            "backend": "gloo",
            "device": device_kind,
            "pipeline_parallel_degree": pp,
            "tensor_parallel_degree": tp,
            "microbatches": microbatches,
        }
    )
    device = smp.state.get_state().device
    assert device.type == device_kind  # "cpu": a check of this test itself, on the CPU
    torch.manual_seed(5)
    reference = tiny_hf_model("llama", VOCAB, SEQ).to(device)
    torch.manual_seed(5)
    if tp > 1:
        with smp.tensor_parallelism():
            module = tiny_hf_model("llama", VOCAB, SEQ)
    else:
        module = tiny_hf_model("llama", VOCAB, SEQ)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    reference_optimizer = parity_adamw(reference.parameters())

    @smp.step
    def train_step(model, ids, mask):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        model.backward(loss)
        return loss

    per_rank = 2 * microbatches
    losses = []
    for step in range(STEPS):
        ids, mask = batch(step, per_rank * smp.dp_size())
        mine = slice(smp.dp_rank() * per_rank, (smp.dp_rank() + 1) * per_rank)
        optimizer.zero_grad()
        out = train_step(model, ids[mine], mask[mine])
        assert all(t.device == device for t in out), "the step's results are on this rank's GPU"
        local = out.reduce_mean().item()
        loss = sum(smp.allgather(local, smp.DP_GROUP)) / smp.dp_size()
        reference_optimizer.zero_grad()
        ref_loss = reference(
            input_ids=ids.to(device), attention_mask=mask.to(device), labels=ids.to(device)
        ).loss
        ref_loss.backward()
        assert abs(loss - ref_loss.item()) <= 1e-4 * (1 + abs(loss)), (step, loss, ref_loss)
        optimizer.step()
        reference_optimizer.step()
        assert_same_state(model, reference)
        losses.append(loss)
    for name, p in model.module.named_parameters():
        if model._owns(name):
            assert p.device == device and p.numel() > 0, name
        else:
            assert p.numel() == 0, f"{name}: another stage's parameter is released"
    return losses


@pytest.mark.parametrize(
    "world, pp, tp, microbatches, keep_min",
    [(2, 2, 1, 4, None), (2, 2, 1, 4, 0), (2, 1, 2, 2, None), (4, 2, 2, 2, None)],
    ids=["pp2", "pp2-every-unread-argument-kept", "tp2", "pp2xtp2"],
)
def test_layouts_sharing_one_gpu_over_gloo(pools, world, pp, tp, microbatches, keep_min):
    results = pools.run(world, _layout_worker, pp, tp, microbatches, "cuda", keep_min)
    assert all(r == results[0] for r in results)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_pipeline_on_nccl_across_two_gpus():
    script = Path(__file__).with_name("nccl_pipeline_script.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(script.parents[1]), *sys.path]))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.count("nccl pipeline ok") == 2, done.stdout[-4000:]

"""SMP v1's ``use_distributed_transformer`` path: a Hugging Face GPT-2 created inside
``smp.model_creation(tensor_parallelism=True, <v1's kernel options>)``, its layers reached as
``model.get_module().transformer.seq_layers`` and placed by hand; the kernel options are each
noted once on rank 0 (or refused, for ALiBi), and a tp_config keyword overrides an init hook's
value when the distributed class takes it (v1's rule)."""

from __future__ import annotations

import logging

import pytest
import torch
from models import tiny_hf_model
from torch import nn

V1_KERNEL_OPTIONS = dict(
    fused_softmax=True, fused_bias_gelu=True, fused_dropout=False, attention_in_fp32=False,
    query_key_layer_scaling=True, flash_attention=True, distribute_embedding=False,
    zero_init=False, use_alibi=False, fp32_residual_addition=False,
)  # fmt: skip


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _v1_gpt2_worker(pp: int, tp: int):
    import smp

    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": 2})
    records = _Records()
    logging.getLogger("smp").addHandler(records)
    try:
        torch.manual_seed(0)
        with smp.model_creation(tensor_parallelism=True, dtype=torch.float32, **V1_KERNEL_OPTIONS):
            model = tiny_hf_model("gpt2", 64, 8, use_cache=False)
        model = smp.DistributedModel(model, trace_device="gpu")  # v1's scripts ask for "gpu"
        m = model.get_module()
        layers = m.transformer.seq_layers  # v1's name for the layer list
        assert layers is m.transformer.h
        assert not any("seq_layers" in k for k in m.state_dict())
        for i, layer in enumerate(layers.children()):  # v1's manual placement loop
            smp.set_partition(layer, i * pp // len(layers))
        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)

        @smp.step
        def train_step(model, ids):
            loss = model(input_ids=ids, labels=ids)["loss"]
            model.backward(loss)
            return loss

        g = torch.Generator().manual_seed(smp.dp_rank())
        ids = torch.randint(0, 64, (4, 8), generator=g)
        losses = []
        for _ in range(4):
            optimizer.zero_grad()
            losses.append(train_step(model, ids).reduce_mean().item())
            optimizer.step()
            scheduler.step()
        notes = [line for line in records.lines if line.startswith("smp: ") and "=" in line]
        alibi = smp.model_creation(tensor_parallelism=True, use_alibi=True)
        with pytest.raises(NotImplementedError, match="ALiBi"), alibi:
            pass
        return losses, notes, sorted(model.distributed_modules)
    finally:
        logging.getLogger("smp").removeHandler(records)


@pytest.mark.parametrize("pp,tp", [(1, 2), (2, 1)])
def test_v1_distributed_transformer_path(pools, pp, tp):
    results = pools.run(pp * tp, _v1_gpt2_worker, pp, tp, timeout_s=300)
    losses, notes, distributed = results[0]
    assert all(r[0][-1] < r[0][0] for r in results), [r[0] for r in results]
    if tp > 1:
        assert "transformer.h.0" in distributed, distributed
    # Each option no smp module takes is noted, once, on rank 0 (the pool may have noted some
    # in an earlier test: notes never repeat within a process).
    for note in notes:
        key = note.split("=")[0].removeprefix("smp: ")
        assert key in V1_KERNEL_OPTIONS and "fp32_residual_addition" not in note, note
    assert len(notes) == len(set(notes))
    assert all(not r[1] for r in results[1:])


class _Box(nn.Module):
    def __init__(self, size, factor):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size, size))
        self.factor = factor


def _override_worker():
    import smp

    smp.init({"tensor_parallel_degree": 2})

    class DistBox(smp.nn.DistributedModule):
        def __init__(self, size, factor, optimize="speed"):
            super().__init__()
            self.factor, self.optimize = factor, optimize
            self.weight = self._shard(torch.zeros(size, size), 0)

    smp.tp_register_with_module(_Box, DistBox, init_hook=lambda size, factor: ((size, factor), {}))
    with smp.tensor_parallelism(
        factor=3.0, unknown_key=1
    ):  # factor overrides; unknown is not passed
        box = _Box(4, 1.0)
    model = smp.DistributedModel(box)
    return type(model.module).__name__, model.module.factor


def test_tp_config_overrides_the_init_hook(pools):
    assert pools.run(2, _override_worker, timeout_s=120) == [("DistBox", 3.0)] * 2

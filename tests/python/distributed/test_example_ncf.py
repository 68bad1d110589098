"""examples/ncf: NeuMF with tensor-parallel embedding tables.

The script (written the SMP v1 way, its configuration from ``--config`` or from flags) trains at
tp 2 x dp 2 and at pp 2 x tp 2, and the loss falls; and the model, its four tables marked and
split over 2 ranks, matches one process with the same seed and data: loss, predictions, every
gradient and every parameter after each of three AdamW steps.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from models import parity_adamw
from test_tp_parity import TOL32, full_grads

NCF = REPO / "examples" / "ncf"
TABLES = ["gmf_item", "gmf_user", "mlp_item", "mlp_user"]


def _load_ncf_model():
    """examples/ncf/model.py under its own name (examples/gpt/model.py is ``model``)."""
    if "ncf_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ncf_model", NCF / "model.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["ncf_model"] = module
        spec.loader.exec_module(module)
    return sys.modules["ncf_model"]


ncf = _load_ncf_model()


@pytest.mark.parametrize(
    "args,groups",
    [
        (["--config", str(NCF / "config.json")], "pp 1 x tp 2 x rdp 2"),
        (["--pp", "2", "--tp", "2", "--microbatches", "2"], "pp 2 x tp 2 x rdp 1"),
    ],
    ids=["tp2_dp2_config", "pp2_tp2_flags"],
)
def test_ncf_example_trains(args, groups):
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    for name in ("SMP_CONFIG", "SM_HP_MP_PARAMETERS"):
        env.pop(name, None)
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", "4", str(NCF / "train.py"), "--steps", "12", *args,
        ],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]  # non-zero when the loss did not fall
    assert groups in out, out[-4000:]
    assert "tensor parallel: gmf_user, gmf_item, mlp_user, mlp_item" in out, out[-4000:]
    assert "ncf done: loss" in out, out[-4000:]


# ---- parity: tp 2 against one process ------------------------------------------------------------

USERS, ITEMS, LOCAL_POSITIVES, NEGATIVES = 32, 64, 2, 4


def _parity_worker(tp: int, microbatches: int) -> list[float]:
    import smp

    smp.init({"tensor_parallel_degree": tp, "microbatches": microbatches})
    torch.manual_seed(11)
    reference = ncf.NeuMF(USERS, ITEMS, gmf_dim=8, mlp_layers=(16, 8))
    torch.manual_seed(11)
    net = ncf.NeuMF(USERS, ITEMS, gmf_dim=8, mlp_layers=(16, 8))
    for table in net.embedding_tables():  # as examples/ncf/train.py marks them
        smp.set_tensor_parallelism(table)
    model = smp.DistributedModel(net)
    assert sorted(model.distributed_modules) == TABLES
    assert model.module.gmf_user.weight.shape == (USERS // tp, 8)  # rows split
    assert model.module.mlp_item.weight.shape == (ITEMS // tp, 8)
    optimizer = smp.DistributedOptimizer(parity_adamw(model.parameters()))
    reference_optimizer = parity_adamw(reference.parameters())
    data = ncf.make_interactions(USERS, ITEMS, per_user=6, eval_negatives=20, seed=3)

    @smp.step
    def train_step(model, users, items, labels):
        loss = F.binary_cross_entropy_with_logits(model(users, items), labels)
        model.backward(loss)
        return loss

    @smp.step
    def predict_step(model, users, items):
        return model(users, items)

    rows = LOCAL_POSITIVES * microbatches * (1 + NEGATIVES)  # this rank's samples
    mine = slice(smp.dp_rank() * rows, (smp.dp_rank() + 1) * rows)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)  # the global batch, the same everywhere
        users, items, labels = ncf.sample_batch(
            data, LOCAL_POSITIVES * microbatches * smp.dp_size(), NEGATIVES, g
        )
        optimizer.zero_grad()
        loss = train_step(model, users[mine], items[mine], labels[mine]).reduce_mean().item()
        global_loss = sum(smp.allgather(loss, smp.DP_GROUP)) / smp.dp_size()
        reference_optimizer.zero_grad()
        reference_loss = F.binary_cross_entropy_with_logits(reference(users, items), labels)
        reference_loss.backward()
        assert abs(global_loss - reference_loss.item()) < 1e-5, (step, global_loss, reference_loss)
        grads = full_grads(model)
        assert sorted(grads) == sorted(n for n, _ in reference.named_parameters())
        for name, q in reference.named_parameters():
            torch.testing.assert_close(
                grads[name], q.grad, **TOL32, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}"
            )
        optimizer.step()
        reference_optimizer.step()
        full = model.state_dict()
        for name, q in reference.state_dict().items():
            torch.testing.assert_close(
                full[name], q, **TOL32, msg=lambda m, n=name, s=step: f"step {s} param {n}: {m}"
            )
        losses.append(global_loss)

    with torch.no_grad():  # evaluation: this rank's scores equal the reference's
        scores = predict_step(model, users[mine], items[mine]).concat()
        torch.testing.assert_close(scores, reference(users[mine], items[mine]), **TOL32)
    return losses


@pytest.mark.parametrize("world,microbatches", [(2, 2), (4, 1)], ids=["tp2", "tp2_dp2"])
def test_ncf_tp_parity(pools, world, microbatches):
    results = pools.run(world, _parity_worker, 2, microbatches)
    assert all(r == results[0] for r in results)

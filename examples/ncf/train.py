"""Train Neural Collaborative Filtering (NeuMF) with smp, its embedding tables tensor-parallel.

Written the way SageMaker model parallelism v1 scripts are written: it ports from v1 by changing
its import line alone. The four embedding tables (GMF and MLP, users and items: nearly all of the
parameters) are marked for tensor parallelism; at tensor_parallel_degree > 1 smp.DistributedModel
replaces each by a vocab-parallel smp.nn.DistributedEmbedding, its rows split over the TP group.

    torchrun --standalone --nproc_per_node 4 examples/ncf/train.py --config examples/ncf/config.json
    torchrun --standalone --nproc_per_node 4 examples/ncf/train.py --pp 2 --tp 2 --microbatches 2
    python examples/ncf/train.py                     # one process

Configuration: ``--pp`` / ``--tp`` / ``--microbatches``, when any is given, build the dict given to
``smp.init`` (over the keys of ``--config``'s file, if given too). Otherwise ``smp.init()`` reads
it from the environment: ``--config FILE`` sets ``SMP_CONFIG`` to the file, or
``SM_HP_MP_PARAMETERS`` as SageMaker sets it; without either every key takes its default.

Data: synthetic implicit feedback generated at start, the same in every process (users and
items with latent factors; each user's positives drawn where the factors' product is high), one
positive per user held out. Each step every data-parallel rank (each TP rank too: smp gives a TP
group's ranks different samples) draws its own training pairs with 4 negatives per positive. At
the end the hit rate at 10 ranks each user's held-out item among 99 items the user never touched
(leave-one-out), the users shared out over the data-parallel ranks and the hits summed.

The job prints ``ncf done: loss A -> B, HR@10 X`` and exits non-zero if the loss did not fall.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
try:
    import smp  # v1: import smdistributed.modelparallel.torch as smp
except ImportError:  # running from a source checkout without installing smp
    sys.path.insert(0, str(HERE.parents[1]))
    import smp

sys.path.insert(0, str(HERE.parent))  # examples/: the shared flags
from smp_args import (  # noqa: E402
    add_smp_arguments,
    first_and_last_loss,
    init_smp,
    rank_device,
)

sys.path.insert(0, str(HERE))
from model import NeuMF, hits_at_k, make_interactions, sample_batch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_smp_arguments(p)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--batch-size", type=int, default=128, help="positive pairs per data-parallel rank per step"
    )
    p.add_argument("--negatives", type=int, default=4, help="sampled negatives per positive")
    p.add_argument("--users", type=int, default=512)
    p.add_argument("--items", type=int, default=1024)
    p.add_argument("--gmf-dim", type=int, default=16)
    p.add_argument("--mlp-layers", type=int, nargs="+", default=[64, 32, 16])
    p.add_argument("--lr", type=float, default=1e-2)
    return p.parse_args(argv)


@smp.step
def train_step(model, users, items, labels):
    logits = model(users, items)
    loss = F.binary_cross_entropy_with_logits(logits, labels)
    model.backward(loss)
    return loss


@smp.step
def predict_step(model, users, items):
    return model(users, items)


def hit_rate(model, data, rows_per_step: int, device: torch.device) -> float:
    """HR@10 over every user: each data-parallel rank scores its share of the users' candidates
    (rows_per_step at a time, the last call padded: every rank makes the same calls) and the hits
    are summed over the data-parallel group. Users beyond a multiple of dp_size are left out."""
    per_rank = data.num_users // smp.dp_size()
    users_U = torch.arange(smp.dp_rank() * per_rank, (smp.dp_rank() + 1) * per_rank)
    candidates_UC = data.candidates_UC[users_U]
    users_R = users_U[:, None].expand_as(candidates_UC).reshape(-1)
    items_R = candidates_UC.reshape(-1)
    scores = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(users_R), rows_per_step):
            rows = slice(start, start + rows_per_step)
            users, items = users_R[rows], items_R[rows]
            n = len(users)
            if n < rows_per_step:
                users = torch.cat([users, users[:1].expand(rows_per_step - n)])
                items = torch.cat([items, items[:1].expand(rows_per_step - n)])
            out = predict_step(model, users.to(device), items.to(device)).concat()
            scores.append(out[:n].float().cpu())
    hits = int(hits_at_k(torch.cat(scores).view(candidates_UC.shape), k=10).sum())
    return sum(smp.allgather(hits, smp.DP_GROUP)) / (per_rank * smp.dp_size())


def main(argv=None) -> int:
    args = parse_args(argv)
    init_smp(smp, args)
    device = rank_device(smp)

    data = make_interactions(args.users, args.items, seed=args.seed)
    torch.manual_seed(args.seed)  # every rank builds the same model
    net = NeuMF(args.users, args.items, args.gmf_dim, tuple(args.mlp_layers))
    for table in net.embedding_tables():  # split along its rows when tensor_parallel_degree > 1
        smp.set_tensor_parallelism(table)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.steps, eta_min=args.lr / 10
    )
    if smp.rank() == 0:
        distributed = {id(m) for m in model.distributed_modules()}
        names = [n for n, m in model.get_module().named_modules() if id(m) in distributed]
        split = ", ".join(names) or "nothing"
        print(
            f"ncf: {args.users} users, {args.items} items, {len(data.train_users_P)} training "
            f"pairs; pp {smp.pp_size()} x tp {smp.tp_size()} x rdp {smp.rdp_size()}; "
            f"tensor parallel: {split}",
            flush=True,
        )

    rows_per_step = args.batch_size * (1 + args.negatives)
    # A multiple of the training batch, so it splits into microbatches as that does.
    eval_rows = rows_per_step * max(1, 4096 // rows_per_step)
    hr_before = hit_rate(model, data, eval_rows, device)

    gen = torch.Generator().manual_seed(1000 * args.seed + smp.dp_rank())  # own data per dp rank
    losses = []
    bar = tqdm(range(args.steps), desc="ncf", disable=smp.rank() != 0)
    for step in bar:
        users, items, labels = sample_batch(data, args.batch_size, args.negatives, gen)
        model.train()
        optimizer.zero_grad()
        loss = train_step(model, users.to(device), items.to(device), labels.to(device))
        loss = loss.reduce_mean()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if step == 0 and smp.pp_size() > 1 and smp.rank() == 0:  # partitioned by the first step
            report = getattr(model, "partition_report", None)  # smp's, not in v1
            if report is not None:
                tqdm.write(report())
        bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")

    hr = hit_rate(model, data, eval_rows, device)
    first, last = first_and_last_loss(smp, losses, 5)
    if smp.rank() == 0:
        print(
            f"ncf done: loss {first:.4f} -> {last:.4f}, HR@10 {hr:.3f} (untrained {hr_before:.3f}),"
            f" {args.steps} steps, global batch {rows_per_step * smp.dp_size()} pairs",
            flush=True,
        )
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())

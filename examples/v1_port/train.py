"""A training script written the way SageMaker model parallelism v1 scripts are written, ported
to smp by changing one line: the import. Everything else is v1's API as v1's documentation
gives it: ``smp.init()`` reading the job's configuration from ``SM_HP_MP_PARAMETERS``,
``smp.tensor_parallelism`` around the model, ``smp.DistributedModel`` / ``DistributedOptimizer``
with a torch LR scheduler on the optimizer, ``model.get_module()``, ``smp.nn.FusedLayerNorm``,
the group getters and ``smp.step``.

    SM_HP_MP_PARAMETERS='{"partitions": 2, "microbatches": 4, "ddp": true}' \\
        torchrun --standalone --nproc_per_node 4 examples/v1_port/train.py

The model predicts the next token of sequences that follow ``x[t+1] = (5 x[t] + 3) mod V``; the
job exits non-zero if the loss did not fall.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import smp  # v1: import smdistributed.modelparallel.torch as smp
except ImportError:  # running from a source checkout without installing smp
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import smp


class Block(nn.Module):
    def __init__(self, hidden: int, dropout: float):
        super().__init__()
        self.norm = smp.nn.FusedLayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class TokenModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, dropout) for _ in range(layers))
        self.norm = smp.nn.FusedLayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@smp.step
def train_step(model, input_ids, labels):
    logits = model(input_ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
    model.backward(loss)
    return loss


def batches(vocab: int, batch: int, seq: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(seq):
            x[:, t + 1] = (5 * x[:, t] + 3) % vocab
        yield x[:, :-1], x[:, 1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel rank")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    smp.init()  # the configuration comes from SM_HP_MP_PARAMETERS, as under SageMaker
    torch.manual_seed(0)
    with smp.tensor_parallelism(enabled=smp.tp_size() > 1):
        model = TokenModel(args.vocab, args.hidden, args.layers, dropout=0.1)
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)
    net = model.get_module()
    if smp.rank() == 0:
        print(
            f"v1-style job: pp group {smp.get_pp_group()}, tp group {smp.get_tp_group()}, "
            f"dp group {smp.get_dp_group()}; {sum(p.numel() for p in net.parameters())} "
            "parameters on rank 0",
            flush=True,
        )

    losses = []
    seed = 1000 + smp.dp_rank()  # each data-parallel rank its own data
    global_batch = args.batch_size * smp.dp_size()
    for step, (ids, labels) in enumerate(
        batches(args.vocab, args.batch_size, 16, args.steps, seed)
    ):
        model.train()
        optimizer.zero_grad()
        loss = train_step(model, ids, labels).reduce_mean()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if smp.rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            lr = scheduler.get_last_lr()[0]
            print(f"step {step:3d}  loss {losses[-1]:.4f}  lr {lr:.2e}", flush=True)
    smp.barrier()
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    if smp.rank() == 0:
        print(f"v1-style job done: loss {first:.3f} -> {last:.3f}, global batch {global_batch}")
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())

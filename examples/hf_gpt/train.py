"""Train a Hugging Face GPT-2 (transformers.GPT2LMHeadModel) with smp, written the SMP v1 way.

The model is ``GPT2LMHeadModel(GPT2Config(**sizes))``, its sizes from a JSON file of GPT2Config
keywords (``--model-config``: a path, or the name of one in configs/: tiny, small, gpt3-175b).
The script ports from SMP v1 by changing its import line alone.

    torchrun --standalone --nproc_per_node 4 examples/hf_gpt/train.py --pp 2 --tp 2
    torchrun --standalone --nproc_per_node 4 examples/hf_gpt/train.py --config smp.json
    python examples/hf_gpt/train.py                              # one process
    python examples/hf_gpt/train.py --model-config gpt3-175b --plan-only --pp 8

Configuration: ``--pp`` / ``--tp`` / ``--microbatches``, when any is given, build the dict given to
``smp.init`` (over the keys of ``--config``'s file, if given too). Otherwise ``smp.init()`` reads
it from the environment: ``--config FILE`` sets ``SMP_CONFIG`` to the file, or
``SM_HP_MP_PARAMETERS`` as SageMaker sets it; without either every key takes its default. With
tensor_parallel_degree > 1 the model is created inside ``smp.tensor_parallelism()``: its
embedding (vocab-split, tied to the LM head), blocks and LayerNorms are split over the TP group.

``--plan-only`` trains nothing and needs no launcher: it builds the model on the meta device (no
weight is allocated, so any size works, GPT-3 175B included) and prints the partition smp would
use over ``--pp`` stages, ``smp.plan_partition(model, one_microbatch, pp).report()``.

Data: synthetic, generated at start: token sequences that follow ``x[t+1] = (5 x[t] + 3) mod V``
from a random first token, different on every data-parallel rank (each TP rank too: smp gives a
TP group's ranks different samples). The job prints ``hf_gpt done: loss A -> B`` and exits
non-zero if the loss did not fall.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

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
    warmup_then_linear,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model-config",
        default="tiny",
        help="JSON file of GPT2Config keywords, or a name in configs/ (tiny, small, gpt3-175b)",
    )
    add_smp_arguments(p)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank")
    p.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence (default: n_positions; to train, at most 64)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10, help="steps between loss lines")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="print the partition plan of a meta-device model over --pp stages and exit",
    )
    return p.parse_args(argv)


def load_model_config(name: str) -> GPT2Config:
    path = Path(name)
    if not path.exists() and not name.endswith(".json"):
        path = HERE / "configs" / f"{name}.json"
    return GPT2Config(**json.loads(path.read_text()))


def plan_only(args: argparse.Namespace, cfg: GPT2Config) -> int:
    """The partition smp would use, from a model on the meta device: shapes, no storage."""
    pp = args.pp
    if pp is None and args.config:
        keys = json.loads(args.config.read_text())
        pp = keys.get("pipeline_parallel_degree", keys.get("partitions"))
    pp = pp or 2
    seq = args.seq_len or cfg.n_positions
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    example = {"input_ids": torch.zeros(1, seq, dtype=torch.long, device="meta")}
    plan = smp.plan_partition(model, example, pp)
    print(
        f"hf_gpt plan: {n_params / 1e9:.2f}B parameters ({cfg.n_layer} layers, n_embd "
        f"{cfg.n_embd}, vocab {cfg.vocab_size}) on the meta device, {pp} stages, one microbatch "
        f"of 1 x {seq} tokens, planned in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    print(plan.report(), flush=True)
    return 0


def batches(vocab: int, batch: int, seq: int, steps: int, gen: torch.Generator):
    """``steps`` batches of (batch, seq) token ids following x[t+1] = (5 x[t] + 3) mod vocab."""
    for _ in range(steps):
        x = torch.empty(batch, seq, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(seq - 1):
            x[:, t + 1] = (5 * x[:, t] + 3) % vocab
        yield x


@smp.step
def train_step(model, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids).loss  # HF shifts the labels itself
    model.backward(loss)
    return loss


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = load_model_config(args.model_config)
    if args.plan_only:
        return plan_only(args, cfg)

    init_smp(smp, args)
    device = rank_device(smp)

    torch.manual_seed(args.seed)  # every rank builds the same model
    with smp.tensor_parallelism(enabled=smp.tp_size() > 1):
        net = GPT2LMHeadModel(cfg)
    n_params = sum(p.numel() for p in net.parameters())
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))
    scheduler = warmup_then_linear(optimizer, args.steps)
    seq = args.seq_len or min(cfg.n_positions, 64)
    if smp.rank() == 0:
        split = ", ".join(model.distributed_modules) or "nothing"
        print(
            f"hf_gpt: GPT2LMHeadModel, {n_params / 1e6:.2f}M parameters ({cfg.n_layer} layers, "
            f"n_embd {cfg.n_embd}, vocab {cfg.vocab_size}); pp {smp.pp_size()} x tp "
            f"{smp.tp_size()} x rdp {smp.rdp_size()}; tensor parallel: {split}",
            flush=True,
        )

    gen = torch.Generator().manual_seed(1000 * args.seed + smp.dp_rank())  # own data per dp rank
    data = list(batches(cfg.vocab_size, args.batch_size, seq, args.steps, gen))  # all at start
    losses = []
    bar = tqdm(data, desc="hf_gpt", disable=smp.rank() != 0)
    for step, input_ids in enumerate(bar):
        model.train()
        optimizer.zero_grad()
        loss = train_step(model, input_ids.to(device)).reduce_mean()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if smp.rank() == 0:
            if step == 0 and smp.pp_size() > 1:  # partitioned by the first step
                tqdm.write(model.partition_report())
            lr = scheduler.get_last_lr()[0]
            bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{lr:.1e}")
            if step % args.log_every == 0 or step == args.steps - 1:
                tqdm.write(f"step {step:4d}  loss {losses[-1]:.4f}  lr {lr:.2e}")

    first, last = first_and_last_loss(smp, losses, 3)
    if smp.rank() == 0:
        print(
            f"hf_gpt done: loss {first:.4f} -> {last:.4f}, {args.steps} steps, global batch "
            f"{args.batch_size * smp.dp_size()} x {seq} tokens",
            flush=True,
        )
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())

"""Pretrain BERT or RoBERTa with masked language modelling under smp, written the SMP v1 way.

The model is an unmodified ``transformers.BertForMaskedLM`` or ``RobertaForMaskedLM``
(``--model bert|roberta``) built from a ``BertConfig`` / ``RobertaConfig`` of the sizes given by
the flags. The script ports from SMP v1 by changing its import line alone.

    torchrun --standalone --nproc_per_node 4 examples/bert_mlm/train.py --pp 2 --tp 2
    torchrun --standalone --nproc_per_node 4 examples/bert_mlm/train.py \\
        --config examples/bert_mlm/smp_config.json
    torchrun --standalone --nproc_per_node 2 examples/bert_mlm/train.py --model roberta --tp 2
    python examples/bert_mlm/train.py                            # one process

Configuration: ``--pp`` / ``--tp`` / ``--microbatches``, when any is given, build the dict given to
``smp.init`` (over the keys of ``--config``'s file, if given too). Otherwise ``smp.init()`` reads
it from the environment: ``--config FILE`` sets ``SMP_CONFIG`` to the file, or
``SM_HP_MP_PARAMETERS`` as SageMaker sets it; without either every key takes its default. With
tensor_parallel_degree > 1 the model is created inside ``smp.tensor_parallelism()``.

Data: synthetic, generated at start, different on every data-parallel rank (each TP rank too:
smp gives a TP group's ranks different samples): ``[CLS] x_1 .. x_n [SEP]``, n drawn per
sequence; the ordinary tokens are split into ``--topics`` groups, a sequence keeps to one, and
within it follows ``x[t+1] = (5 x[t] + 3) mod group_size`` from a random first token. Each
batch is padded to its longest sequence with an attention mask, so the padding (and the batch's
length) differs from rank to rank and step to step. Masking as BERT's: 15% of the ordinary
tokens (at least one per sequence) are predicted; of those 80% become [MASK], 10% a random
token and 10% stay. The job prints ``<model>_mlm done: loss A -> B`` and exits non-zero
if the loss did not fall.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

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

PAD, CLS, SEP, MASK = 0, 1, 2, 3  # special tokens; the ordinary ones are SPECIAL..vocab-1
SPECIAL = 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("bert", "roberta"), default="bert")
    add_smp_arguments(p)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=32, help="longest sequence, [CLS] and [SEP] in")
    p.add_argument("--min-len", type=int, default=8, help="shortest sequence")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--topics", type=int, default=8, help="token groups a sequence keeps to")
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10, help="steps between loss lines")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace):
    sizes = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        pad_token_id=PAD,
    )
    if args.model == "bert":
        return BertForMaskedLM(BertConfig(max_position_embeddings=args.seq_len, **sizes))
    # RoBERTa numbers positions from pad_token_id + 1: two more position embeddings.
    config = RobertaConfig(
        max_position_embeddings=args.seq_len + 2, bos_token_id=CLS, eos_token_id=SEP, **sizes
    )
    return RobertaForMaskedLM(config)


def make_batch(args: argparse.Namespace, gen: torch.Generator):
    """One batch: (input_ids, attention_mask, labels), padded to its longest sequence."""
    size = (args.vocab - SPECIAL) // args.topics  # ordinary tokens per topic
    lengths = torch.randint(args.min_len, args.seq_len + 1, (args.batch_size,), generator=gen)
    width = int(lengths.max())
    tokens = torch.empty(args.batch_size, width - 2, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, size, (args.batch_size,), generator=gen)
    for t in range(width - 3):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % size
    topic = torch.randint(0, args.topics, (args.batch_size, 1), generator=gen)
    ids = torch.full((args.batch_size, width), PAD, dtype=torch.long)
    ids[:, 1:-1] = SPECIAL + topic * size + tokens
    ids[:, 0] = CLS
    positions = torch.arange(width)
    ids[positions[None, :] == lengths[:, None] - 1] = SEP
    attention_mask = (positions[None, :] < lengths[:, None]).long()
    ids[attention_mask == 0] = PAD

    # BERT's masking: 15% of the ordinary tokens predicted, at least one per sequence.
    ordinary = ids >= SPECIAL
    chosen = ordinary & (torch.rand(ids.shape, generator=gen) < args.mask_prob)
    one = torch.multinomial(ordinary.float(), 1, generator=gen)  # a random ordinary token each
    chosen.scatter_(1, one, True)
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    draw = torch.rand(ids.shape, generator=gen)
    random_tokens = torch.randint(SPECIAL, args.vocab, ids.shape, generator=gen)
    input_ids = torch.where(chosen & (draw < 0.8), torch.full_like(ids, MASK), ids)
    input_ids = torch.where(chosen & (draw >= 0.8) & (draw < 0.9), random_tokens, input_ids)
    return input_ids, attention_mask, labels


@smp.step
def train_step(model, input_ids, attention_mask, labels):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    model.backward(loss)
    return loss


def main(argv=None) -> int:
    args = parse_args(argv)
    init_smp(smp, args)
    device = rank_device(smp)

    torch.manual_seed(args.seed)  # every rank builds the same model
    with smp.tensor_parallelism(enabled=smp.tp_size() > 1):
        net = build_model(args)
    n_params = sum(p.numel() for p in net.parameters())
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    )
    scheduler = warmup_then_linear(optimizer, args.steps)
    name = f"{args.model}_mlm"
    if smp.rank() == 0:
        split = ", ".join(model.distributed_modules) or "nothing"
        print(
            f"{name}: {type(net).__name__}, {n_params / 1e6:.2f}M parameters ({args.layers} "
            f"layers, hidden {args.hidden}, vocab {args.vocab}); pp {smp.pp_size()} x tp "
            f"{smp.tp_size()} x rdp {smp.rdp_size()}; tensor parallel: {split}",
            flush=True,
        )

    gen = torch.Generator().manual_seed(1000 * args.seed + smp.dp_rank())  # own data per dp rank
    data = [make_batch(args, gen) for _ in range(args.steps)]  # every step's batch, at start
    losses = []
    bar = tqdm(data, desc=name, disable=smp.rank() != 0)
    for step, (input_ids, attention_mask, labels) in enumerate(bar):
        model.train()
        optimizer.zero_grad()
        loss = train_step(
            model, input_ids.to(device), attention_mask.to(device), labels.to(device)
        ).reduce_mean()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if smp.rank() == 0:
            if step == 0 and smp.pp_size() > 1:  # partitioned by the first step
                tqdm.write(model.partition_report())
            lr = scheduler.get_last_lr()[0]
            bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{lr:.1e}")
            if step % args.log_every == 0 or step == args.steps - 1:
                tqdm.write(
                    f"step {step:4d}  loss {losses[-1]:.4f}  lr {lr:.2e}  batch "
                    f"{tuple(input_ids.shape)}, {int((attention_mask == 0).sum())} padding"
                )

    first, last = first_and_last_loss(smp, losses, 3)
    if smp.rank() == 0:
        print(
            f"{name} done: loss {first:.4f} -> {last:.4f}, {args.steps} steps, global batch "
            f"{args.batch_size * smp.dp_size()} sequences of {args.min_len}-{args.seq_len} tokens",
            flush=True,
        )
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())

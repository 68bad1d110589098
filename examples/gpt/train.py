"""Train a small byte-level GPT with smp: the project's demo training job.

Launch (four processes: the model split over 2 pipeline stages by smp's partitioner, and each
transformer block split over 2 tensor-parallel ranks; --pp and --tp pick the degrees, the
remaining processes are data parallel):

    torchrun --nproc_per_node 4 examples/gpt/train.py

or single-process (smp.init runs world size 1 without the torchrun environment):

    python examples/gpt/train.py

Rank 0 prints which blocks were split, the partition report after the first step, progress (a
tqdm bar with the loss and tokens/s, and a line every --log-every steps), the validation loss at
the start and the end, and one summary line. The job exits non-zero if the training loss did not
fall.

Shape suffix legend: B batch, T sequence length, V vocabulary (256 bytes), N bytes in a split.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
try:
    import smp
except ImportError:  # running from a source checkout without installing smp
    sys.path.insert(0, str(HERE.parents[1]))
    import smp

sys.path.insert(0, str(HERE))
from model import BLOCK_TP_PLAN, GPT, Block, GPTConfig, lm_loss  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=HERE / "data" / "tiny.txt")
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument(
        "--pp",
        type=int,
        default=None,
        help="pipeline_parallel_degree: stages the model is split over, the remaining processes "
        "are data parallel (default: 2 when the number of processes is even, else 1)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor_parallel_degree: ranks each transformer block is split over (default: 2 "
        "when the number of processes is a multiple of 4, else 1)",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="checkpoint directory: the training state is saved there at the end "
        "(smp.save_checkpoint, tag step_<n>; the two newest are kept)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint: model, optimizer, step and "
        "random state (saved under any pp x tp x dp layout)",
    )
    p.add_argument(
        "--no-activation-checkpointing",
        dest="activation_checkpointing",
        action="store_false",
        help="keep every block's activations instead of recomputing them in backward",
    )
    p.add_argument(
        "--no-shard-optimizer-state",
        dest="shard_optimizer_state",
        action="store_false",
        help="keep the whole optimizer state on every data-parallel rank instead of a share",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also evaluate every this many steps (0: only at the start and the end)",
    )
    return p.parse_args(argv)


def load_bytes(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The file's bytes as token ids, split 90/10 into (train_N, val_N)."""
    raw = bytearray(path.read_bytes())
    data_N = torch.frombuffer(raw, dtype=torch.uint8).long()
    n_train = int(0.9 * len(data_N))
    return data_N[:n_train], data_N[n_train:]


def make_generator(*key: int) -> torch.Generator:
    """A generator seeded from a tuple of ints, identical in every process."""
    digest = hashlib.sha256(":".join(map(str, key)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def sample_batch(
    data_N: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs x_BT and next-byte targets y_BT."""
    if len(data_N) <= seq_len + 1:
        raise ValueError(f"split of {len(data_N)} bytes is too short for --seq-len {seq_len}")
    start_B = torch.randint(len(data_N) - seq_len - 1, (batch_size,), generator=gen)
    window_BT = data_N[start_B[:, None] + torch.arange(seq_len + 1)]
    return window_BT[:, :-1], window_BT[:, 1:]


@smp.step
def train_step(model, x_BT, y_BT):
    logits_BTV = model(x_BT)
    loss = lm_loss(logits_BTV, y_BT)
    model.backward(loss)
    return loss


@smp.step
def eval_step(model, x_BT, y_BT):
    return lm_loss(model(x_BT), y_BT)


def dp_mean(value: float) -> float:
    """Mean of a Python float over the data-parallel group."""
    values = smp.allgather(value, smp.DP_GROUP)
    return sum(values) / len(values)


def say(line: str) -> None:
    """Rank 0's line above the progress bar (tqdm.write), flushed at once like the others."""
    tqdm.write(line)
    sys.stdout.flush()


def print_memory(model, optimizer, args) -> None:
    """One line per rank (printed by rank 0): the bytes of the parameters, gradients and
    optimizer state it holds, counted from the tensors."""

    def mib(tensors) -> float:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) / 2**20

    params = [p for p in model.parameters() if p.numel() > 0]
    mine = (
        f"rank {smp.rank()} (pp {smp.pp_rank()}, tp {smp.tp_rank()}, rdp {smp.rdp_rank()}): "
        f"parameters {mib(params):.2f} MiB, gradients {mib(p.grad for p in params):.2f} MiB, "
        f"optimizer state {optimizer.state_bytes() / 2**20:.2f} MiB"
        + (
            f" (1/{smp.rdp_size()} share)"
            if args.shard_optimizer_state and smp.rdp_size() > 1
            else ""
        )
        + ("; blocks checkpointed" if args.activation_checkpointing else "")
    )
    lines = smp.allgather(mine, smp.WORLD)
    if smp.rank() == 0:
        print("memory:\n  " + "\n  ".join(lines), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)

    # smp configuration in one place: pipeline_parallel_degree / tensor_parallel_degree go here.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp is None:
        args.tp = 2 if world % 4 == 0 else 1
    if args.pp is None:
        args.pp = 2 if (world // args.tp) % 2 == 0 else 1
    smp_config = {
        "microbatches": args.microbatches,
        "pipeline_parallel_degree": args.pp,
        "tensor_parallel_degree": args.tp,
        # Memory savers: each data-parallel rank keeps the AdamW state of its share of the
        # parameters (ZeRO-1; no effect without data parallelism).
        "shard_optimizer_state": args.shard_optimizer_state,
    }
    smp.init(smp_config)
    is_main = smp.rank() == 0
    if args.batch_size % args.microbatches != 0:
        raise ValueError(
            f"--batch-size {args.batch_size} is not divisible by --microbatches {args.microbatches}"
        )

    device = (
        torch.device("cuda", smp.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    )
    train_N, val_N = load_bytes(args.data)

    # Same seed on every rank, so every rank builds the same model (smp also broadcasts the
    # parameters from dp rank 0).
    torch.manual_seed(args.seed)
    cfg = GPTConfig(
        block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
    )
    net = GPT(cfg)
    n_params = net.num_parameters()
    # Tensor parallelism: a sharding plan for the block class (its own forward keeps running; Q,
    # K, V and MLP-in become column shards, the two output projections row shards; model.py),
    # and every block marked. smp.DistributedModel splits them and shards the weights in.
    smp.tp_register_plan(Block, **BLOCK_TP_PLAN)
    for block in net.h:
        smp.set_tensor_parallelism(block)
    if args.activation_checkpointing:  # each block keeps only its input; recomputed in backward
        smp.set_activation_checkpointing(net.h)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))
    start = 0
    if args.resume:
        if args.checkpoint is None:
            raise ValueError("--resume needs --checkpoint: the directory the earlier run saved to")
        # Returns the user content now; the model's and optimizer's state (resharded if this
        # run's layout differs) and the random state load once the first step has partitioned
        # the model, as in SMP v1.
        start = smp.resume_from_checkpoint(str(args.checkpoint))["step"]

    dp, pp, tp = smp.dp_size(), smp.pp_size(), smp.tp_size()
    if is_main:
        print(
            f"gpt: {n_params / 1e6:.2f}M parameters, {cfg.n_layer} layers, n_embd {cfg.n_embd}, "
            f"{len(train_N)} train / {len(val_N)} val bytes from {args.data.name}",
            flush=True,
        )
        if model.distributed_modules:
            print(
                f"tensor parallel: {', '.join(model.distributed_modules)} split over "
                f"{tp} ranks each",
                flush=True,
            )

    # One fixed validation batch per dp rank, so evaluations are comparable.
    val_x_BT, val_y_BT = sample_batch(
        val_N, args.batch_size, args.seq_len, make_generator(args.seed, -1, smp.dp_rank())
    )
    val_x_BT, val_y_BT = val_x_BT.to(device), val_y_BT.to(device)

    def evaluate(label: str) -> float:
        with torch.no_grad():
            val_loss = dp_mean(eval_step(model, val_x_BT, val_y_BT).reduce_mean().item())
        if is_main:
            say(f"{label}val loss {val_loss:.3f}")
        return val_loss

    evaluate("start: ")

    # Every data-parallel replica (the dp group includes the tp ranks, each of which is fed its
    # own batch) consumes batch_size * seq_len tokens per step.
    tokens_per_step = args.batch_size * args.seq_len * dp
    first_loss = loss_val = float("nan")
    train_time = 0.0
    last = start + args.steps
    steps = range(start + 1, last + 1)  # the bar counts from `start`, as a resumed run does
    bar = tqdm(steps, desc="gpt", total=last, initial=start, disable=not is_main)
    for step in bar:
        t0 = time.perf_counter()
        gen = make_generator(args.seed, step, smp.dp_rank())
        x_BT, y_BT = sample_batch(train_N, args.batch_size, args.seq_len, gen)
        x_BT, y_BT = x_BT.to(device), y_BT.to(device)

        optimizer.zero_grad()
        loss = train_step(model, x_BT, y_BT).reduce_mean()
        optimizer.step()
        loss_val = dp_mean(loss.item())
        train_time += time.perf_counter() - t0

        if step == start + 1:
            first_loss = loss_val
            if is_main and pp > 1:  # the model was partitioned by this first step
                say(model.partition_report())
        if is_main:
            tok_s = (step - start) * tokens_per_step / train_time
            bar.set_postfix({"loss": f"{loss_val:.2f}", "tok/s": f"{tok_s:.0f}"})
            if step % args.log_every == 0 or step == last:
                say(f"step {step}/{last}  loss {loss_val:.2f}  {tok_s:.0f} tok/s")
        if args.eval_every and step % args.eval_every == 0 and step != last:
            evaluate(f"step {step}: ")

    evaluate("end: ")
    print_memory(model, optimizer, args)
    if args.checkpoint is not None:  # every rank writes its part
        written = smp.save_checkpoint(
            str(args.checkpoint),
            f"step_{last}",
            user_content={"step": last},
            num_kept_partial_checkpoints=2,
        )
        if is_main:
            print(
                f"checkpoint: step {last} saved to {written} (pp {pp} x tp {tp} x "
                f"{smp.rdp_size()} data-parallel); continue with --checkpoint {args.checkpoint} "
                "--resume, under this layout or another",
                flush=True,
            )
    tok_s = args.steps * tokens_per_step / train_time if train_time > 0 else 0.0
    if is_main:
        print(
            f"done: steps {start + 1}-{last}, {tok_s:.0f} tokens/s, final loss {loss_val:.4f} "
            f"(first {first_loss:.2f}), world size {smp.size()} = pp {pp} x tp {tp} x "
            f"{smp.rdp_size()} data-parallel, "
            f"microbatches {args.microbatches}",
            flush=True,
        )
    if not loss_val < first_loss:  # also catches NaN
        if is_main:
            print(
                f"error: training loss did not fall (first {first_loss:.4f}, final {loss_val:.4f})",
                file=sys.stderr,
                flush=True,
            )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

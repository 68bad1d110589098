"""Shared by the benchmark scripts: run a function on N local gloo processes, and time steps.

``run_ranks(fn, world, *args)`` spawns ``world`` processes, each of which joins a gloo world on a
free local port with one CPU thread and calls ``fn(rank, *args)``; whatever rank 0's call returns
comes back to the caller. ``SMP_BENCH_PIN=1`` in the environment pins process ``rank`` and every
thread it starts to CPU ``rank`` (modulo the CPUs), as ``taskset`` would: the benchmarks'
``--pin``. ``timed(step, batches, warmup)`` times a training loop on every rank.
``smp_training(module, loss, lr)`` is the usual smp training step, ``loss(model, *batch)`` its loss.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    torch.set_num_threads(1)
    if os.environ.get("SMP_BENCH_PIN") == "1":  # before any thread starts: they inherit it
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    result = fn(rank, *args)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args: Any) -> Any:
    """Runs ``fn(rank, *args)`` on ``world`` gloo processes; returns rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").Queue()
    mp.start_processes(
        _entry, args=(world, port, fn, args, out), nprocs=world, start_method="spawn"
    )
    return out.get(timeout=10)


def timed(step: Callable, batches: list, warmup: int) -> float:
    """Seconds for ``step(*batch)`` over ``batches[warmup:]``, after the warm-up batches, between
    two barriers (so the slowest rank decides)."""
    for batch in batches[:warmup]:
        step(*batch)
    dist.barrier()
    start = time.perf_counter()
    for batch in batches[warmup:]:
        step(*batch)
    dist.barrier()
    return time.perf_counter() - start


def smp_training(module: torch.nn.Module, loss: Callable, lr: float):
    """``(model, step)``: ``module`` wrapped in ``smp.DistributedModel`` with AdamW at ``lr``, and
    ``step(*batch)``, which zeroes the gradients, runs an ``smp.step`` of ``loss(model, *batch)``
    with ``model.backward`` and steps the optimizer (smp must be initialised)."""
    import smp

    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=lr))

    @smp.step
    def train_step(model, *batch):
        value = loss(model, *batch)
        model.backward(value)
        return value

    def step(*batch):
        opt.zero_grad()
        train_step(model, *batch)
        opt.step()

    return model, step


def output_loss(loss_fn: Callable) -> Callable:
    """``smp_training``'s ``loss`` for a model taking ``x`` and a loss of its output and ``y``."""
    return lambda model, x, y: loss_fn(model(x), y)

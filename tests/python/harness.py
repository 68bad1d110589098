"""Run a function on N gloo processes, reusing the processes across tests.

A :class:`WorkerPool` of a given world size starts N spawned processes once; each joins a gloo
default process group and then runs the functions it is sent. Importing torch and joining the
group are paid once per pool, not once per test. Functions must be importable module-level
callables (they are pickled by reference); arguments and results must be picklable.

After every task a worker calls ``smp.shutdown()`` so the next test starts clean. A task that
fails, times out or loses a process breaks the pool: it is killed and the next request builds a
new one, so one broken test cannot hang or poison the following ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180.0
_GRACE_AFTER_FAILURE_S = 20.0


@dataclasses.dataclass
class Outcome:
    """What one rank did with a task: status is "ok", "error" or "died"."""

    rank: int
    status: str
    value: Any = (
        None  # the return value ("ok"), the traceback text ("error"), the exit code ("died")
    )


class DistributedTestFailure(AssertionError):
    """A task failed on at least one rank; the message has every failing rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    import smp

    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
            results.put((rank, "error", traceback.format_exc()))
        finally:
            smp.shutdown()
    dist.destroy_process_group()


class WorkerPool:
    """N persistent worker processes forming one gloo world."""

    def __init__(self, world_size: int, startup_timeout_s: float = 120.0):
        self.world_size = world_size
        self.broken = False
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        port = _free_port()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, self._tasks[rank], self._results),
                daemon=True,
                name=f"smp-test-rank{rank}",
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        outcomes = self._collect(startup_timeout_s)
        if any(o.status != "ready" for o in outcomes):
            self.close()
            raise DistributedTestFailure(
                f"worker pool of {world_size} failed to start:\n" + _describe(outcomes)
            )

    def _collect(self, timeout_s: float) -> list[Outcome]:
        """Waits for one message per rank; records dead processes and stragglers."""
        outcomes: dict[int, Outcome] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, status, value = self._results.get(timeout=min(0.2, deadline - now))
                outcomes[rank] = Outcome(rank, status, value)
                if status in ("error",):
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
                continue
            except queue.Empty:
                pass
            for rank, proc in enumerate(self._procs):
                if rank not in outcomes and not proc.is_alive():
                    outcomes[rank] = Outcome(rank, "died", proc.exitcode)
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
        for rank in range(self.world_size):
            if rank not in outcomes:
                outcomes[rank] = Outcome(rank, "timeout", timeout_s)
        return [outcomes[r] for r in range(self.world_size)]

    def run_outcomes(
        self, fn: Callable, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs
    ) -> list[Outcome]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns each rank's :class:`Outcome`.

        Any outcome other than "ok" breaks the pool (it is closed)."""
        if self.broken:
            raise RuntimeError("worker pool is broken; get a new one")
        for task_queue in self._tasks:
            task_queue.put((fn, args, kwargs))
        outcomes = self._collect(timeout_s)
        if any(o.status != "ok" for o in outcomes):
            self.close()
        return outcomes

    def run(self, fn: Callable, *args, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> list[Any]:
        """Runs ``fn`` on every rank and returns the per-rank results; raises
        :class:`DistributedTestFailure` naming each failing rank with its traceback."""
        outcomes = self.run_outcomes(fn, *args, timeout_s=timeout_s, **kwargs)
        if any(o.status != "ok" for o in outcomes):
            name = getattr(fn, "__qualname__", repr(fn))
            raise DistributedTestFailure(
                f"{name} failed on {self.world_size} ranks:\n" + _describe(outcomes)
            )
        return [o.value for o in outcomes]

    def close(self) -> None:
        self.broken = True
        for proc, task_queue in zip(self._procs, self._tasks):
            if proc.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    task_queue.put(None)
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def _describe(outcomes: list[Outcome]) -> str:
    lines = []
    for o in outcomes:
        if o.status == "ok" or o.status == "ready":
            lines.append(f"--- rank {o.rank}: ok")
        elif o.status == "error":
            lines.append(f"--- rank {o.rank}: raised\n{o.value}")
        elif o.status == "died":
            lines.append(f"--- rank {o.rank}: process died with exit code {o.value}")
        else:
            lines.append(f"--- rank {o.rank}: no answer within {o.value:.0f} s (hang?)")
    return "\n".join(lines)


class PoolSet:
    """One live pool per world size, rebuilt when broken."""

    def __init__(self):
        self._pools: dict[int, WorkerPool] = {}

    def get(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = WorkerPool(world_size)
            self._pools[world_size] = pool
        return pool

    def run(self, world_size: int, fn: Callable, *args, **kwargs) -> list[Any]:
        return self.get(world_size).run(fn, *args, **kwargs)

    def run_outcomes(self, world_size: int, fn: Callable, *args, **kwargs) -> list[Outcome]:
        return self.get(world_size).run_outcomes(fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

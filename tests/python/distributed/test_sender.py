"""smp.pipeline.sender.Sender (over smp._C.Sender) between gloo processes: per-peer order,
waiting sends, and close() bounded by timeout_s, naming the peer that took nothing.

The C++ sender_test covers the same over ranks as threads, plus batching and failed sends; this
checks the Python face and real gloo."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from smp import _C
from smp.pipeline.sender import Sender

_TAG = 13
_TIMEOUT_S = 30.0


def _group():
    return dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))


def _in_order(num: int) -> None:
    rank = dist.get_rank()
    group = _group()
    transport = _C.Transport(group, [1 - rank], _TIMEOUT_S, _TAG)
    transport.start()
    sender = Sender(transport, [1 - rank], _TIMEOUT_S)
    for i in range(num):
        sender.send(1 - rank, [rank, i], [torch.full((i % 5 + 1,), float(i))] if i % 2 else [])
    sender.send(1 - rank, [rank, num], [torch.arange(4000.0)], wait=True)
    for i in range(num + 1):
        peer, header, tensors = transport.recv(_TIMEOUT_S)
        assert (peer, header) == (1 - rank, [1 - rank, i]), (peer, header, i)
        if i == num:
            assert torch.equal(tensors[0], torch.arange(4000.0))
        elif i % 2:
            assert torch.equal(tensors[0], torch.full((i % 5 + 1,), float(i)))
        else:
            assert tensors == []
    assert sender.close() is None and sender.error is None
    transport.finish()
    dist.destroy_process_group(group)


def test_messages_arrive_in_order_both_ways(pools):
    pools.run(2, _in_order, 300, timeout_s=120)


def _silent_peer() -> float:
    rank = dist.get_rank()
    group = _group()
    elapsed = 0.0
    if rank == 0:
        transport = _C.Transport(group, [1], _TIMEOUT_S, _TAG)
        transport.start()
        sender = Sender(transport, [1], 0.5)
        sender.send(1, [0], [torch.ones(100)])
        start = time.monotonic()
        error = sender.close()
        elapsed = time.monotonic() - start
        assert isinstance(error, TimeoutError), error
        assert "stage(s) 1 were not all sent within timeout_s=0.5 s" in str(error), error
        assert not transport.started  # aborted to stop the send
    dist.barrier()  # rank 1 never started a transport on this group
    dist.destroy_process_group(group)
    return elapsed


def test_close_names_a_peer_that_takes_nothing(pools):
    elapsed = pools.run(2, _silent_peer, timeout_s=60)[0]
    assert 0.4 < elapsed < 5.0, elapsed

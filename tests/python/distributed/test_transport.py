"""smp._C.Transport over real gloo groups: the pipeline runtime's messages between processes.

What the C++ transport_test (ranks as threads over a fake backend) cannot check: that a Python
ProcessGroup crosses into C++, that gloo's send/recv pair up as the transport expects (FIFO per
peer and tag, rendezvous sends), that Work::abort() wakes a receiver blocked in gloo, and that the
blocking calls release the GIL.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from smp import _C

_TAG = 11
_TIMEOUT_S = 30.0  # bounds every wait that should succeed


def _group(world: int):
    """A fresh gloo group over all ranks (every rank calls this in the same order)."""
    return dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))


def _tensors(src: int, dst: int, i: int) -> list[torch.Tensor]:
    """The tensors of message i from src to dst: several dtypes, a 0-dim and an empty tensor."""
    base = 100 * src + 10 * dst + i
    return [
        torch.arange(6, dtype=torch.float32).reshape(2, 3) + base,
        torch.full((), base * 0.5, dtype=torch.float64),
        torch.arange(5, dtype=torch.int64) * (i + 1) - src,
        torch.arange(4).remainder(2 + i % 2).eq(0),  # bool
        torch.zeros(0, 3, dtype=torch.float32),
        (torch.arange(3, dtype=torch.float32) + base).to(torch.bfloat16),
        torch.complex(torch.arange(2.0) + base, -torch.arange(2.0)),
        (torch.arange(8, dtype=torch.int8) - 4 + i % 3).reshape(2, 2, 2).transpose(0, 2),
    ]


def _check(message, src: int, dst: int, i: int, header: list[int]) -> None:
    peer, got_header, tensors = message
    assert peer == src, (peer, src)
    assert got_header == header, (got_header, header)
    expected = _tensors(src, dst, i)
    assert len(tensors) == len(expected)
    for k, (got, want) in enumerate(zip(tensors, expected)):
        assert got.dtype == want.dtype and got.shape == want.shape, (k, got, want)
        assert torch.equal(got, want), f"message {i} from {src}, tensor {k}: {got} != {want}"


def _ping_pong_and_all_to_all(num_rounds: int) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _group(world)
    peers = [r for r in range(world) if r != rank]
    transport = _C.Transport(group, peers, _TIMEOUT_S, _TAG)
    assert (transport.rank, transport.peers, transport.tag) == (rank, peers, _TAG)
    transport.start()
    assert transport.started
    # 1. Ping-pong: rank 0 pings every peer, each answers with the tensors it got, doubled where
    #    that means something, so both directions are checked.
    for r in range(num_rounds):
        if rank == 0:
            for peer in peers:
                transport.send(peer, [0, r, -(2**40)], _tensors(0, peer, r))
            for _ in peers:
                peer, header, tensors = transport.recv(_TIMEOUT_S)
                assert header == [1, r, peer]
                want = _tensors(0, peer, r)
                assert torch.equal(tensors[0], want[0] * 2)
                assert torch.equal(tensors[1], want[2] + 1)
                assert torch.equal(tensors[2], ~want[3])
        else:
            message = transport.recv(_TIMEOUT_S)
            _check(message, 0, rank, r, [0, r, -(2**40)])
            t = message[2]
            transport.send(0, [1, r, rank], [t[0] * 2, t[2] + 1, ~t[3]])
    # 2. All-to-all: everyone sends to everyone at once, then receives from everyone. (The
    #    barrier keeps these messages out of the ping-pong's receives.)
    dist.barrier(group)
    num = 5
    for peer in peers:
        for i in range(num):
            transport.send(peer, [rank, i], _tensors(rank, peer, i))
    next_index = dict.fromkeys(peers, 0)
    for _ in range(num * len(peers)):
        message = transport.recv(_TIMEOUT_S)
        src = message[0]
        _check(message, src, rank, next_index[src], [src, next_index[src]])
        next_index[src] += 1
    transport.finish()
    assert not transport.started
    dist.destroy_process_group(group)
    return rank


@pytest.mark.parametrize("world", [2, 3])
def test_ping_pong_and_all_to_all(pools, world):
    assert pools.run(world, _ping_pong_and_all_to_all, 3, timeout_s=120) == list(range(world))


def _order_over_many_messages(num: int) -> None:
    rank = dist.get_rank()
    group = _group(2)
    transport = _C.Transport(group, [1 - rank], _TIMEOUT_S, _TAG)
    transport.start()
    # Both directions at once: a Python thread sends while the main thread receives.
    sender = threading.Thread(
        target=lambda: [
            transport.send(1 - rank, [rank, i, i * i], _tensors(rank, 1 - rank, i))
            for i in range(num)
        ]
    )
    sender.start()
    for i in range(num):
        _check(transport.recv(_TIMEOUT_S), 1 - rank, rank, i, [1 - rank, i, i * i])
    sender.join()
    transport.finish()
    dist.destroy_process_group(group)


def test_order_preserved_over_100_messages(pools):
    pools.run(2, _order_over_many_messages, 100, timeout_s=120)


def _batches(num: int) -> None:
    """send_batch over gloo, both directions at once: batches of up to 9 messages, some with
    tensors too big for the header (their parts are received together) and large batches the
    transport splits over several wire messages, mixed with plain sends; every message arrives
    alone, intact and in order."""
    rank = dist.get_rank()
    group = _group(2)
    transport = _C.Transport(group, [1 - rank], _TIMEOUT_S, _TAG)
    transport.start()

    def message(i):
        tensors = _tensors(rank, 1 - rank, i)
        if i % 3 == 0:  # two payloads past the header's room
            tensors += [torch.arange(3000.0) * i, torch.full((40, 50), i, dtype=torch.int64)]
        return [rank, i, -i], tensors

    def send():
        i = 0
        while i < num:
            size = i % 10  # 0: a plain send
            if size == 0:
                transport.send(1 - rank, *message(i))
                i += 1
            else:
                batch = [message(j) for j in range(i, min(num, i + size))]
                transport.send_batch(1 - rank, batch)
                i += len(batch)

    sender = threading.Thread(target=send)
    sender.start()
    for i in range(num):
        peer, header, tensors = transport.recv(_TIMEOUT_S)
        assert (peer, header) == (1 - rank, [1 - rank, i, -i])
        want = _tensors(1 - rank, rank, i)
        if i % 3 == 0:
            want += [torch.arange(3000.0) * i, torch.full((40, 50), i, dtype=torch.int64)]
        assert len(tensors) == len(want), i
        for got, expected in zip(tensors, want):
            assert got.dtype == expected.dtype and torch.equal(got, expected), i
    sender.join()
    # One batch of many header-only messages needs several wire messages: all arrive.
    transport.send_batch(1 - rank, [([rank, i] + [i] * 40, []) for i in range(100)])
    for i in range(100):
        assert transport.recv(_TIMEOUT_S) == (1 - rank, [1 - rank, i] + [i] * 40, [])
    with pytest.raises(ValueError, match=r"message 1 of 2: the message does not fit"):
        transport.send_batch(1 - rank, [([0], []), ([0] * 600, [])])
    transport.finish()
    dist.destroy_process_group(group)


def test_batches_arrive_as_their_messages_in_order(pools):
    pools.run(2, _batches, 150, timeout_s=120)


def _none_after_peer_finished() -> None:
    rank = dist.get_rank()
    group = _group(2)
    transport = _C.Transport(group, [1 - rank], _TIMEOUT_S, _TAG)
    transport.start()
    if rank == 1:
        transport.send(0, [7], [])
        transport.finish()
    else:
        assert transport.recv(_TIMEOUT_S) == (1, [7], [])
        assert transport.recv(_TIMEOUT_S) is None  # rank 1's END: nothing more can come
        transport.finish()
    dist.destroy_process_group(group)


def test_recv_returns_none_once_every_peer_finished(pools):
    pools.run(2, _none_after_peer_finished, timeout_s=60)


def _silent_peer(timeout_s: float) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _group(world)
    transport = _C.Transport(group, [r for r in range(world) if r != rank], _TIMEOUT_S, _TAG)
    transport.start()
    elapsed = 0.0
    if rank == 0:
        # Rank 2 (if any) sends one message; rank 1 never does.
        if world == 3:
            assert transport.recv(_TIMEOUT_S)[0] == 2
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            transport.recv(timeout_s)
        elapsed = time.monotonic() - start
        assert isinstance(info.value, _C.TransportError)
        message = str(info.value)
        want_open = "[1]" if world == 2 else "[1, 2]"
        assert f"no message within {int(timeout_s * 1000)} ms" in message, message
        assert f"channels still open (no END yet) from peers {want_open}" in message, message
        assert "rank 0" in message and f"tag {_TAG}" in message, message
    elif rank == 2:
        transport.send(0, [2], [torch.ones(3)])
    # A recv timeout is not fatal: the step still ends cleanly on every rank.
    dist.barrier(group)
    transport.finish()
    dist.destroy_process_group(group)
    return elapsed


@pytest.mark.parametrize("world", [2, 3])
def test_silent_peer_makes_recv_raise_naming_it(pools, world):
    elapsed = pools.run(world, _silent_peer, 1.0, timeout_s=60)[0]
    assert 0.9 < elapsed < 5.0, elapsed


def _reuse_over_steps(num_steps: int) -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _group(world)
    peers = [r for r in range(world) if r != rank]
    transport = _C.Transport(group, peers, _TIMEOUT_S, _TAG)
    received = []
    for step in range(num_steps):
        transport.start()
        for peer in peers:
            for i in range(step + 1):  # a different number of messages each step
                transport.send(peer, [step, i], [torch.full((2, 2), float(step * 10 + i))])
        count = 0
        next_index = dict.fromkeys(peers, 0)
        for _ in range((step + 1) * len(peers)):
            src, header, tensors = transport.recv(_TIMEOUT_S)
            assert header == [step, next_index[src]], (src, header)
            assert torch.equal(tensors[0], torch.full((2, 2), float(step * 10 + next_index[src])))
            next_index[src] += 1
            count += 1
        transport.finish()
        received.append(count)
    dist.destroy_process_group(group)
    return received


def test_reuse_over_three_steps(pools):
    results = pools.run(3, _reuse_over_steps, 3, timeout_s=120)
    assert results == [[2, 4, 6]] * 3


def _idle_channel_outlives_group_timeout() -> None:
    rank = dist.get_rank()
    # The group's own timeout is 2 s; the channel stays idle for 4 s.
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    transport = _C.Transport(group, [1 - rank], _TIMEOUT_S, _TAG)
    transport.start()
    if rank == 0:
        peer, header, tensors = transport.recv(_TIMEOUT_S)
        assert (peer, header) == (1, [4])
        assert torch.equal(tensors[0], torch.arange(3))
    else:
        time.sleep(4.0)
        transport.send(0, [4], [torch.arange(3)])
    transport.finish()
    dist.destroy_process_group(group)


def test_idle_channel_outlives_the_group_timeout(pools):
    # A receiver waiting with gloo's default (the group's timeout) would close the group's pairs
    # after 2 s; see Note [Idle receivers] in csrc/torch/transport.cpp.
    pools.run(2, _idle_channel_outlives_group_timeout, timeout_s=60)


def _gil_released_while_waiting() -> int:
    rank = dist.get_rank()
    group = _group(2)
    transport = _C.Transport(group, [1 - rank], _TIMEOUT_S, _TAG)
    transport.start()
    ticks = 0
    if rank == 0:
        result = {}
        waiter = threading.Thread(target=lambda: result.update(m=transport.recv(_TIMEOUT_S)))
        waiter.start()
        while waiter.is_alive():
            ticks += 1
            time.sleep(0.001)
        waiter.join()
        assert result["m"][1] == [5]
    else:
        time.sleep(1.0)
        transport.send(0, [5], [torch.ones(2)])
    transport.finish()
    dist.destroy_process_group(group)
    return ticks


def test_gil_released_while_waiting(pools):
    ticks = pools.run(2, _gil_released_while_waiting, timeout_s=60)[0]
    assert ticks > 50, f"main thread starved while recv() waited ({ticks} ticks): GIL held?"


def _finish_without_peer() -> None:
    rank = dist.get_rank()
    group = _group(2)
    transport = _C.Transport(group, [1 - rank], 1.0, _TAG)
    transport.start()
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(_C.TransportError, match=r"no END from peers \[1\] within 1000 ms"):
            transport.finish()
        assert time.monotonic() - start < 5.0
        assert not transport.started
        with pytest.raises(ValueError, match="after a failure"):
            transport.start()
    dist.barrier()  # the default group: `group` may be unusable after an abort
    if rank == 1:
        # Never finished: abort() closes the step without END (its receiver already ended on
        # rank 0's END; _destroy_without_finish covers waking receivers blocked in gloo).
        start = time.monotonic()
        transport.abort()
        assert time.monotonic() - start < 5.0
        with pytest.raises(_C.TransportError, match="aborted"):
            transport.recv(1.0)
    start = time.monotonic()
    del transport  # after abort(): nothing left to do
    assert time.monotonic() - start < 1.0
    dist.barrier()


def test_finish_names_a_peer_that_never_finishes(pools):
    pools.run(2, _finish_without_peer, timeout_s=60)


def _destroy_without_finish() -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = _group(world)
    transport = _C.Transport(group, [r for r in range(world) if r != rank], 60.0, _TAG)
    transport.start()
    time.sleep(0.2)  # the receivers are now blocked in gloo's recv
    start = time.monotonic()
    del transport
    elapsed = time.monotonic() - start
    dist.barrier()
    return elapsed


def test_destroying_a_started_transport_does_not_hang(pools):
    for elapsed in pools.run(3, _destroy_without_finish, timeout_s=60):
        assert elapsed < 5.0, elapsed


def _user_mistakes() -> None:
    rank = dist.get_rank()
    group = _group(2)
    peer = 1 - rank
    for args, pattern in [
        ((group, [rank], 1.0, _TAG), "is this rank"),
        ((group, [2], 1.0, _TAG), "not a rank of the group"),
        ((group, [peer, peer], 1.0, _TAG), "listed twice"),
        ((group, [peer], 0.0, _TAG), "timeout_s must be > 0"),
        ((group, [peer], float("nan"), _TAG), "timeout_s"),
        ((group, [peer], 1.0, -1), "tag must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            _C.Transport(*args)
    with pytest.raises(TypeError):
        _C.Transport("world", [peer], 1.0, _TAG)

    transport = _C.Transport(group, [peer], _TIMEOUT_S, _TAG)
    with pytest.raises(ValueError, match=r"start\(\) first"):
        transport.send(peer, [], [])
    transport.start()
    capacity = _C.Transport.header_capacity([torch.ones(2, 2)])
    assert capacity == 512 - 5 - 4
    with pytest.raises(ValueError, match=f"{capacity + 1} header ints, room for {capacity}"):
        transport.send(peer, [0] * (capacity + 1), [torch.ones(2, 2)])
    with pytest.raises(ValueError, match="not one of its peers"):
        transport.send(5, [], [])
    with pytest.raises(ValueError, match="Sparse"):
        transport.send(peer, [], [torch.ones(2, 2).to_sparse()])
    with pytest.raises(ValueError, match="meta"):
        transport.send(peer, [], [torch.empty(2, device="meta")])
    with pytest.raises(ValueError, match="timeout_s"):
        transport.recv(-1.0)
    # Nothing was sent: the step still ends cleanly, and a full header goes through.
    transport.send(peer, list(range(capacity)), [torch.ones(2, 2)])
    src, header, tensors = transport.recv(_TIMEOUT_S)
    assert (src, header) == (peer, list(range(capacity)))
    assert len(tensors) == 1 and torch.equal(tensors[0], torch.ones(2, 2))
    transport.finish()
    dist.destroy_process_group(group)


def test_user_mistakes_raise_value_error(pools):
    pools.run(2, _user_mistakes, timeout_s=60)

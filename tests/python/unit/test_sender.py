"""smp.pipeline.sender.Sender: per-peer FIFO order, what queued up sent as one batch, waiting
sends, the first error raised by the next send and returned by close (with the transport
aborted), and close bounded by timeout_s."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from smp.pipeline.sender import Sender


class FakeTransport:
    def __init__(self, fail_on: int | None = None, gate: threading.Event | None = None):
        self.sent: list[tuple[int, list[int]]] = []
        self.fail_on = fail_on
        self.gate = gate
        self.aborted = False
        self.lock = threading.Lock()

        self.batches: list[int] = []  # messages per transport call
        self.entered = threading.Event()  # a send has begun

    def send(self, peer, header, tensors):
        self.send_batch(peer, [(header, tensors)])

    def send_batch(self, peer, messages):
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if any(header[0] == self.fail_on for header, _ in messages):
            raise RuntimeError(f"peer {peer} is gone")
        with self.lock:
            self.sent.extend((peer, list(header)) for header, _ in messages)
            self.batches.append(len(messages))

    def abort(self):
        self.aborted = True
        if self.gate is not None:
            self.gate.set()  # as Transport.abort fails the sends in flight


def test_messages_to_each_peer_keep_their_order():
    transport = FakeTransport()
    sender = Sender(transport, [1, 2], 10.0)
    for i in range(50):
        sender.send(1 + i % 2, [i], [torch.zeros(3)])
    assert sender.close() is None
    for peer in (1, 2):
        got = [h[0] for p, h in transport.sent if p == peer]
        assert got == [i for i in range(50) if 1 + i % 2 == peer]


def test_send_returns_before_the_message_is_taken_unless_asked_to_wait():
    gate = threading.Event()
    transport = FakeTransport(gate=gate)
    sender = Sender(transport, [1], 10.0)
    sender.send(1, [0], [])  # returns although the transport is blocked
    assert transport.sent == []
    waiter = threading.Thread(target=sender.send, args=(1, [1], []), kwargs={"wait": True})
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waits for its message, behind the first
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive()
    assert [h for _, h in transport.sent] == [[0], [1]]
    assert sender.close() is None


def test_what_queues_up_while_a_send_is_on_the_wire_goes_as_one_batch():
    gate = threading.Event()
    transport = FakeTransport(gate=gate)
    sender = Sender(transport, [1], 10.0)
    sender.send(1, [0], [])  # on the wire until the gate opens
    assert transport.entered.wait(10)
    for i in range(1, 6):
        sender.send(1, [i], [torch.full((2,), i)])
    waiter = threading.Thread(target=sender.send, args=(1, [6], []), kwargs={"wait": True})
    waiter.start()
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive()  # its batch was sent
    assert sender.close() is None
    assert [h[0] for _, h in transport.sent] == list(range(7))
    assert transport.batches[0] == 1 and transport.batches[1] >= 5 and sum(transport.batches) == 7
    assert len(transport.batches) < 7, transport.batches


def test_a_failed_send_is_raised_by_the_next_send_and_returned_by_close():
    transport = FakeTransport(fail_on=7)
    sender = Sender(transport, [1], 10.0)
    with pytest.raises(RuntimeError, match="peer 1 is gone"):
        sender.send(1, [7], [], wait=True)
    assert transport.aborted
    with pytest.raises(RuntimeError, match="peer 1 is gone"):
        sender.send(1, [8], [])
    error = sender.close()
    assert isinstance(error, RuntimeError) and "peer 1 is gone" in str(error)
    assert transport.sent == []  # nothing after the failure went out


def test_close_waits_timeout_s_at_most_and_names_the_peer():
    """A send that never completes (a peer that never receives) is stopped by aborting the
    transport once timeout_s has passed; close says which peer it was sending to."""
    transport = FakeTransport(gate=threading.Event())
    sender = Sender(transport, [3], 0.3)
    sender.send(3, [0], [])
    start = time.monotonic()
    error = sender.close()
    assert time.monotonic() - start < 5
    assert transport.aborted
    assert isinstance(error, TimeoutError), error
    assert "stage(s) 3" in str(error) and "timeout_s=0.3" in str(error), error

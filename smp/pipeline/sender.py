"""Sending a step's pipeline messages without making the sender wait (design.md §4.8).

``Transport.send`` returns only when the peer has taken every part of the message; on gloo that
includes waking the peer's receiver thread, which costs milliseconds when every core is busy
computing. :class:`Sender` hands each message to one thread per peer, which sends them in the
order they were given (so each channel stays FIFO), while the caller goes on computing. The
messages that queue up for a peer while one is on the wire go together, as one
``Transport.send_batch``: a gloo message costs a rendezvous and a wake-up of the peer's receiver
whatever its size, and a stage that calls several modules of another in a row would pay it for
each.

The tensors of a message must not be modified in place until it is sent: the runtime sends
asynchronously only tensors it owns (a served call's outputs, gradients, and copies of a call's
arguments, which belong to the user's code). ``wait=True`` is there for a caller that cannot copy.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import torch

from smp import _C

__all__ = ["Sender"]

_BATCH = 64  # messages sent as one batch at most (the transport packs what fits its header)


class Sender:
    """One sending thread per peer of a started ``smp._C.Transport``, for one step."""

    def __init__(self, transport, peers: list[int], timeout_s: float, device=None):
        self.transport = transport
        self.device = device  # a CUDA device the threads make current (design.md §4.8)
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self._queues = {peer: queue.SimpleQueue() for peer in peers}
        self._threads = [
            threading.Thread(target=self._run, args=(peer,), daemon=True, name=f"smp-send{peer}")
            for peer in peers
        ]
        for thread in self._threads:
            thread.start()

    def send(self, peer: int, header: list[int], tensors: list, wait: bool = False) -> None:
        """Queues a message for ``peer``; with ``wait``, returns once it has been sent.

        Raises the first error of an earlier send (the transport is aborted then).
        """
        if self.error is not None:
            raise self.error
        done = threading.Event() if wait else None
        self._queues[peer].put((header, tensors, done))
        if done is not None:
            # Each send ends within timeout_s (Transport.send fails then); those queued before it
            # may each take as long, so the wait is bounded by the queue, and named if it ends.
            limit = self.timeout_s * (self._queues[peer].qsize() + 1)
            if not done.wait(limit):
                raise TimeoutError(
                    f"smp pipeline: a message to stage {peer} was not sent within {limit:g} s "
                    f"(timeout_s={self.timeout_s:g} per queued message)"
                )
            if self.error is not None:
                raise self.error

    def close(self) -> BaseException | None:
        """Waits until every queued message has been sent (or failed), ends the threads, and
        returns the first send error (None if all went out). Waits timeout_s at most: a sending
        thread still busy then is stopped by aborting the transport (its send fails), and the
        error returned names the peers it was sending to."""
        for q in self._queues.values():
            q.put(None)
        deadline = time.monotonic() + self.timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        late = [peer for peer, t in zip(self._queues, self._threads) if t.is_alive()]
        if late:
            with contextlib.suppress(Exception):
                self.transport.abort()  # the sends fail at once; the threads end
            for thread in self._threads:
                thread.join(self.timeout_s)
            if self.error is None or isinstance(self.error, _C.TransportError):
                self.error = TimeoutError(
                    "smp pipeline: the step's messages to stage(s) "
                    f"{', '.join(map(str, late))} were not all sent within "
                    f"timeout_s={self.timeout_s:g} s after the step ended on this rank"
                )
        return self.error

    def _run(self, peer: int) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        q = self._queues[peer]
        while True:
            # What queued up while the last send was on the wire goes as one batch.
            items = [q.get()]
            while items[-1] is not None and len(items) < _BATCH:
                try:
                    items.append(q.get_nowait())
                except queue.Empty:
                    break
            last = items[-1] is None
            if last:
                items.pop()
            if items and self.error is None:
                try:
                    if len(items) == 1:
                        self.transport.send(peer, items[0][0], items[0][1])
                    else:
                        self.transport.send_batch(peer, [(h, t) for h, t, _ in items])
                except BaseException as exc:  # noqa: BLE001 - raised by the next send or close
                    self.error = exc
                    # The server may be waiting for a message that now cannot come.
                    with contextlib.suppress(Exception):
                        self.transport.abort()
            for _, _, done in items:
                if done is not None:
                    done.set()
            if last:
                return

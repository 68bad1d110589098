"""Sending a step's pipeline messages without making the sender wait (design.md §4.8).

``Transport.send`` returns only when the peer has taken every part of the message; on gloo that
includes waking the peer's receiver thread, which costs milliseconds when every core is busy
computing. ``smp._C.Sender`` (smp/pytorch/sender.h) hands each message to one C++ thread per
peer, which sends them in the order they were given (each channel stays FIFO) while the caller
goes on computing; what queues up while one message is on the wire goes as one batch. Queueing
is a lock and a notify in C++: no Python thread, no GIL hand-off. Device tensors are sent from a
stream of the sender's own that waits on an event recorded where they were produced (Note
[Stream discipline] in transport.cpp).

The tensors of a message must not be modified in place until it is sent: the runtime sends
asynchronously only tensors it owns (a served call's outputs, gradients, and copies of a call's
arguments, which belong to the user's code). ``wait=True`` is there for a caller that cannot copy.
"""

from __future__ import annotations

from smp import _C

__all__ = ["Sender"]


class Sender:
    """One sending thread per peer of a started ``smp._C.Transport``, for one step."""

    def __init__(self, transport, peers: list[int], timeout_s: float):
        self.timeout_s = timeout_s
        self._impl = _C.Sender(transport, peers, timeout_s)

    def send(self, peer: int, header: list[int], tensors: list, wait: bool = False) -> None:
        """Queues a message for ``peer``; with ``wait``, returns once it has been sent.

        Raises the first error of an earlier send (the transport is aborted then).
        """
        self._impl.send(peer, header, tensors, wait)

    @property
    def error(self) -> BaseException | None:
        """The first send error (None while every send went out)."""
        try:
            self._impl.check()
        except BaseException as exc:  # noqa: BLE001 - returned, not raised
            return exc
        return None

    def close(self) -> BaseException | None:
        """Waits until every queued message has been sent (or failed), ends the threads, and
        returns the first send error (None if all went out). Waits timeout_s at most: a sending
        thread still busy then is stopped by aborting the transport (its send fails), and the
        error returned names the peers it was sending to."""
        late = self._impl.close()
        error = self.error
        if late and (error is None or isinstance(error, _C.TransportError)):
            error = TimeoutError(
                "smp pipeline: the step's messages to stage(s) "
                f"{', '.join(map(str, late))} were not all sent within "
                f"timeout_s={self.timeout_s:g} s after the step ended on this rank"
            )
        return error

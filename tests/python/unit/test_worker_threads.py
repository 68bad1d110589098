"""The pipeline runtime's worker threads (smp.pipeline.runtime._Threads)."""

from __future__ import annotations

import threading

from smp.pipeline.runtime import _Threads


class _FakeWorker:
    """Stands for a _Worker: runs until released, parks its thread, then says so."""

    def __init__(self):
        self.release = threading.Event()
        self.parked = threading.Event()
        self.started = False
        self.thread: threading.Thread | None = None

    def run(self, park) -> None:
        self.thread = threading.current_thread()
        assert self.release.wait(30)
        park()
        self.parked.set()

    def finish(self) -> None:
        self.release.set()
        assert self.parked.wait(30)


def test_threads_are_reused_and_all_end_on_close_even_busy_ones():
    threads = _Threads()
    first = _FakeWorker()
    threads.run(first)
    first.finish()
    busy = _FakeWorker()
    threads.run(busy)  # takes the parked thread: no new one
    assert threads.count == 1
    parked = _FakeWorker()
    threads.run(parked)  # a second thread: the first one is busy
    parked.finish()
    threads.close()  # one thread parked, one still running `busy`
    parked.thread.join(30)
    assert not parked.thread.is_alive()
    assert busy.thread.is_alive()
    # A thread busy at close() ends when its worker finishes (it used to park for good,
    # keeping its last worker, and through it the runtime and its groups, alive).
    busy.finish()
    busy.thread.join(30)
    assert not busy.thread.is_alive()
    assert threads.count == 2

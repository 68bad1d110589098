"""The pipeline runtime's worker threads (smp.pipeline.workers._Threads) and the baton they pass
(_Baton)."""

from __future__ import annotations

import threading

from smp.pipeline.workers import _Baton, _Threads


class _FakeWorker:
    """Stands for a _Worker: runs until released, parks its thread, then says so."""

    def __init__(self):
        self.release = threading.Event()
        self.running = threading.Event()  # run() has begun: `thread` is set
        self.parked = threading.Event()
        self.started = False
        self.thread: threading.Thread | None = None

    def run(self, park) -> None:
        self.thread = threading.current_thread()
        self.running.set()
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
    assert busy.running.wait(30)  # run() returns once the worker is queued, not started
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


def test_baton_counts_releases_and_times_out_without_one():
    baton = _Baton()
    assert not baton.acquire(timeout=0.01)  # nothing released: False after the wait
    baton.release()
    baton.release()  # a late worker's return and an abort's wake-up may both come
    assert baton.acquire(timeout=0) and baton.acquire()
    assert not baton.acquire(timeout=0)


def test_baton_hands_off_between_threads():
    go, back = _Baton(), _Baton()
    seen = []

    def worker():
        for i in range(100):
            assert go.acquire(timeout=30)
            seen.append(i)
            back.release()

    thread = threading.Thread(target=worker)
    thread.start()
    for i in range(100):
        go.release()
        assert back.acquire(timeout=30)
        assert seen[-1] == i  # strictly alternating: the worker ran exactly once per grant
    thread.join(30)
    assert seen == list(range(100))

"""The gpu-worker's step thread: every model call on one thread, in order, results and
exceptions handed back to the calling (gRPC pool) thread."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagoda.services.gpu_worker.step_thread import StepThread


def test_calls_from_many_threads_run_on_one_thread_in_turn():
    step = StepThread()
    seen, running = [], []

    def work(i):
        running.append(i)
        assert len(running) == 1, "two calls overlapped"
        seen.append(threading.get_ident())
        running.pop()
        return i * 2

    with ThreadPoolExecutor(8) as callers:  # like gRPC's handler pool
        results = list(callers.map(lambda i: step.run(work, i), range(64)))
    assert results == [i * 2 for i in range(64)]
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()
    step.shutdown()


def test_an_exception_reaches_the_caller_and_the_thread_lives_on():
    step = StepThread()

    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        step.run(fail)
    assert step.run(lambda: 7) == 7
    step.shutdown()

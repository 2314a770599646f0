"""The gpu-worker's step thread: every model call runs on the thread serving the loop
(the process's main thread in the worker), in turn; results and exceptions reach the
calling gRPC pool thread; calls after a stop fail instead of hanging."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagoda.services.gpu_worker.step_thread import StepThread, StepThreadStopped


def _serving(step: StepThread) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    loop = threading.Thread(target=step.serve, args=(stop, 0.05), name="serving")
    loop.start()
    return stop, loop


def test_calls_from_many_threads_run_on_the_serving_thread_in_turn():
    step = StepThread()
    seen, running = [], []

    def work(i):
        running.append(i)
        assert len(running) == 1, "two calls overlapped"
        seen.append(threading.current_thread().name)
        running.pop()
        return i * 2

    with ThreadPoolExecutor(8) as callers:  # like gRPC's handler pool
        pending = [callers.submit(step.run, work, i) for i in range(64)]  # queued before serving
        stop, loop = _serving(step)
        assert [p.result(timeout=10) for p in pending] == [i * 2 for i in range(64)]
    assert set(seen) == {"serving"}
    stop.set()
    loop.join(5)


def test_an_exception_reaches_the_caller_and_the_loop_goes_on():
    step = StepThread()
    stop, loop = _serving(step)

    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        step.run(fail)
    assert step.run(lambda: 7) == 7
    stop.set()
    loop.join(5)
    assert not loop.is_alive()
    with pytest.raises(StepThreadStopped):  # after the stop: refused, not hung
        step.run(lambda: 1)

"""One thread for everything that runs the model: the process's main thread.

gRPC's sync server runs each call on whichever of its pool threads is free, and an
OpenMP runtime (torch's CPU threads) keeps one thread team per calling thread: steps
landing on alternating pool threads wake alternating teams, while the previous team's
threads still spin (GOMP_SPINCOUNT) on the same cores. Measured on a 2-core machine
under `pagoda serve` at concurrency 32: four busy worker threads at 0.26-0.36 cores
each and 1.23 cores used in all, with ExecuteModel busy 93% of the wall time. Running
every model call on one thread keeps one team (and, on CUDA, one current stream). The
thread is the main one (`serve` runs the loop there once the gRPC server is up), the
thread that loaded the model: offline, 32-row decode steps measured 39-48 ms run on the
main thread against 50-55 ms on another thread of the same process.

Invariant: callables run one at a time, in submission order, on the thread running
`serve`; `run` returns what the callable returned or raises what it raised. A call made
before `serve` starts waits for it; one made (or still queued) once `serve` returned
raises StepThreadStopped.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class StepThreadStopped(RuntimeError):
    """The serving loop has stopped (the worker is shutting down): the call never ran."""


class StepThread:
    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._lock = threading.Lock()  # orders the stopped check and the queueing

    def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the serving thread; blocks the caller until it is done."""
        return self.submit(fn, *args).result()

    def submit(self, fn: Callable[..., T], *args) -> Future:
        """Queue fn(*args) on the serving thread; its future (async scheduling queues
        the next step behind the running one, so it starts without a thread switch)."""
        future: Future = Future()
        with self._lock:
            if self._stopped:
                raise StepThreadStopped("the worker is stopping")
            self._calls.put((future, fn, args))
        return future

    def serve(self, stop: threading.Event, poll_s: float = 0.2) -> None:
        """Runs queued calls on this thread until `stop` is set; calls still queued
        then fail with StepThreadStopped."""
        while not stop.is_set():
            try:
                future, fn, args = self._calls.get(timeout=poll_s)
            except queue.Empty:
                continue
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
        with self._lock:
            self._stopped = True
        while True:
            try:
                future, _, _ = self._calls.get_nowait()
            except queue.Empty:
                return
            future.set_exception(StepThreadStopped("the worker is stopping"))

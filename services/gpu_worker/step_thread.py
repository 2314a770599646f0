"""One long-lived thread for everything that runs the model.

gRPC's sync server runs each call on whichever of its pool threads is free, and an
OpenMP runtime (torch's CPU threads) keeps one thread team per calling thread: steps
landing on alternating pool threads wake alternating teams, while the previous team's
threads still spin (GOMP_SPINCOUNT) on the same cores. Measured on a 2-core machine
under `pagoda serve` at concurrency 32: four busy worker threads at 0.26-0.36 cores
each and 1.23 cores used in all, with ExecuteModel busy 93% of the wall time. Running
every model call on one thread keeps one team (and, on CUDA, one current stream).

Invariant: callables run one at a time, in submission order, on the same thread;
`run` returns what the callable returned or raises what it raised.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class StepThread:
    def __init__(self, name: str = "pagoda-step") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the step thread; blocks the caller until it is done."""
        return self._pool.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

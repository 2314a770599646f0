"""How often a worker group may be rebuilt after a failure, and how long it waits first.

A rank that dies or raises once (a killed process, a transient device error) costs
the replica a rebuild: the group serves again within seconds. A rank that fails
again and again is a crash loop, which rebuilding cannot fix: after `max_restarts`
rebuilds within `window_s` the next failure ends the replica, loudly.

    failure ─► allowed? ─ no ─► WorkerGroupFailed (final)
                  │ yes
                  └─► wait backoff ─► rebuild

Before the k-th rebuild inside the window the group waits
`min(backoff_s * 2**(k-1), max_backoff_s)`: a fault outside the process (a GPU
resetting, a port still held) gets time to clear, and a loop does not spin.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

MAX_RESTARTS = 3
WINDOW_S = 300.0
BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


@dataclass
class RestartBudget:
    """Invariant: `restarts` holds the monotonic times of the rebuilds begun within
    the last `window_s`, at most `max_restarts` of them."""

    max_restarts: int = MAX_RESTARTS
    window_s: float = WINDOW_S
    backoff_s: float = BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    clock: object = time.monotonic
    restarts: deque = field(default_factory=deque)

    def next_delay(self) -> float | None:
        """Seconds to wait before the next rebuild (recorded as begun now), or None
        when the budget is spent: the failure is final."""
        now = self.clock()
        while self.restarts and now - self.restarts[0] > self.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.max_restarts:
            return None
        self.restarts.append(now)
        return min(self.backoff_s * 2 ** (len(self.restarts) - 1), self.max_backoff_s)

    def describe(self) -> str:
        return f"{self.max_restarts} rebuilds within {self.window_s:g} s"

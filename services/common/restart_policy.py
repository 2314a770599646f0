"""Restart with backoff and a limit per window: the rule `pagoda serve` applies to its
services (services/cli/supervision.py) and the gateway to its API-server processes
(services/gateway/api_servers.py), shared here so both count the same way.

Invariants: the n-th restart within `window_s` waits `backoff_s * 2**(n-1)` (at most
`max_backoff_s`); an exit that would be restart number `max_restarts + 1` within the
window is a crash loop, which the caller reports instead of hiding.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    """`max_restarts` per unit within `window_s` seconds (0: never restart)."""

    max_restarts: int = 0
    window_s: float = 60.0
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def problem(self) -> str | None:
        if self.max_restarts < 0:
            return "--max-restarts cannot be negative"
        if self.window_s <= 0 or self.backoff_s < 0:
            return "--restart-window must be positive and --restart-backoff not negative"
        return None


@dataclass
class RestartLedger:
    """The restarts of one unit within the policy's window."""

    policy: RestartPolicy
    times: collections.deque = field(default_factory=collections.deque)

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before restarting after an exit at `now` (recorded as a
        restart), or None when that restart would exceed the limit: a crash loop."""
        while self.times and now - self.times[0] > self.policy.window_s:
            self.times.popleft()
        if len(self.times) >= self.policy.max_restarts:
            return None
        self.times.append(now)
        return min(self.policy.max_backoff_s,
                   self.policy.backoff_s * 2 ** (len(self.times) - 1))

    @property
    def recent(self) -> int:
        return len(self.times)

"""How `pagoda serve` restarts a service that exits: like a pod controller.

A *restart unit* is what goes down and comes back together: one service on its own
(gateway, tokenizer, kv-cache-manager), or a whole model replica (its scheduler and
gpu-worker: a scheduler whose worker died keeps running with a failed engine, and a
fresh worker knows nothing of a live scheduler's blocks, so both restart). Invariants:
  * a unit restarts with its own command lines, hence the same ports: peers reconnect
    by themselves (gRPC channels retry a port that answers again);
  * the n-th restart within `window_s` waits `backoff_s * 2**(n-1)` (at most
    `max_backoff_s`); an exit that would be restart number `max_restarts + 1` within
    the window is a crash loop, which the supervisor does not hide;
  * every restarted process counts once in `pagoda_service_restarts_total{service}`,
    which starts at 0 for every service.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter


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


class RestartMetrics:
    """`pagoda_service_restarts_total{service}` in a registry of the supervisor's own
    (the gateway's /metrics includes it through --peer-metrics)."""

    def __init__(self, services: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.restarts = Counter("pagoda_service_restarts",
                                "Times `pagoda serve` restarted a service after it exited.",
                                ["service"], registry=self.registry)
        for name in services:  # 0 from start-up: a rate() sees the first restart
            self.restarts.labels(name)

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

from prometheus_client import CollectorRegistry, Counter

# The rule itself is shared with the gateway's API-server processes.
from pagoda.services.common.restart_policy import RestartLedger, RestartPolicy

__all__ = ["RestartLedger", "RestartMetrics", "RestartPolicy"]


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

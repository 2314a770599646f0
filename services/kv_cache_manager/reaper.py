"""Drops instances whose heartbeat lapsed, and refreshes the index-size gauges.

Runs in a daemon thread of the kv-cache-manager, every `interval` seconds. It
waits one heartbeat timeout after start before it reaps, so a kv-cache-manager
that was down (and so missed heartbeats) does not drop live instances before
they had a chance to call in; the gauges are refreshed from the start.
Several kv-cache-manager replicas may reap the same Redis: dropping is idempotent.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from pagoda.services.kv_cache_manager.index import PrefixIndex
from pagoda.services.kv_cache_manager.metrics import KvIndexMetrics

logger = logging.getLogger(__name__)


class Reaper:
    """Invariant: once running, no instance stays in the index more than
    `heartbeat_timeout + interval` seconds after its last heartbeat."""

    def __init__(self, index: PrefixIndex, metrics: KvIndexMetrics | None = None,
                 interval: float | None = None) -> None:
        self.index = index
        self.metrics = metrics
        self.interval = interval or max(0.1, min(1.0, index.heartbeat_timeout / 4))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-index-reaper", daemon=True)

    def start(self) -> "Reaper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def run_once(self, reap: bool = True) -> None:
        if reap:
            dropped = self.index.reap()
            if dropped and self.metrics is not None:
                self.metrics.dropped_instances.labels("heartbeat").inc(len(dropped))
        if self.metrics is not None:
            self._refresh_gauges()

    def _run(self) -> None:
        reap_from = time.monotonic() + self.index.heartbeat_timeout  # the grace period
        last_error = 0.0
        while not self._stop.wait(self.interval):
            try:
                self.run_once(reap=time.monotonic() >= reap_from)
            except redis.RedisError as exc:
                if time.monotonic() - last_error > 30:
                    last_error = time.monotonic()
                    logger.warning("reaper: redis unavailable: %s", exc)

    def _refresh_gauges(self) -> None:
        blocks: dict[str, int] = {}
        for model, block_size in self.index.namespaces():
            for info in self.index.list_instances(model, block_size):
                blocks[info.instance_id] = blocks.get(info.instance_id, 0) + info.num_blocks
        self.metrics.instances.set(len(blocks))
        self.metrics.blocks.clear()  # instances that left must not linger
        for instance_id, n in blocks.items():
            self.metrics.blocks.labels(instance_id).set(n)

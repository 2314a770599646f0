"""Ships the scheduler's KV events to the kv-cache-manager, off the step's critical path.

The engine thread only appends to a list; this thread sends what accumulated,
at most every `interval` seconds, as one numbered batch. A batch that cannot be
sent is dropped: the sequence number still advances, so the kv-cache-manager
sees the gap (and, with issue 5's resync, recovers).
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from pagoda._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from pagoda.core.kv_events import KVEvent
from pagoda.protocol.kv_events import publish_request
from pagoda.services.common.grpc_server import CLIENT_OPTIONS
from pagoda.services.common.tracing import intercept
from pagoda.services.scheduler.metrics import KvPublisherMetrics

logger = logging.getLogger(__name__)


class KvEventPublisher:
    """Invariant: batches leave in the order their events happened, numbered 0, 1, ..."""

    def __init__(self, address: str, instance_id: str, model: str, block_size: int, epoch: str,
                 interval: float = 0.05, metrics: KvPublisherMetrics | None = None) -> None:
        self.instance_id, self.model, self.block_size, self.epoch = (
            instance_id, model, block_size, epoch)
        self.interval = interval
        self.sequence_number = 0
        self.num_dropped_batches = 0
        self._channel = grpc.insecure_channel(address, options=CLIENT_OPTIONS)
        self._stub = pb_grpc.KvCacheManagerServiceStub(intercept(self._channel))
        self._events: list[KVEvent] = []
        self._oldest_event_time = 0.0  # when the oldest queued event was queued
        self.metrics = metrics
        self._cv = threading.Condition()
        self._stopped = False
        self._last_error_log = 0.0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> "KvEventPublisher":
        self._thread.start()
        return self

    def publish(self, events: list[KVEvent]) -> None:
        """Queue events (called by the engine thread; never blocks on the network)."""
        with self._cv:
            if not self._events:
                self._oldest_event_time = time.monotonic()
            self._events.extend(events)
            self._cv.notify()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout)
        self._channel.close()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._events and not self._stopped:
                    self._cv.wait()
                batch, self._events = self._events, []
                oldest = self._oldest_event_time
                stopped = self._stopped
            if batch:
                self._send(batch, oldest)
            if stopped:
                return
            time.sleep(self.interval)  # let the next batch accumulate

    def _send(self, batch: list[KVEvent], oldest: float) -> None:
        request = publish_request(self.instance_id, self.model, self.block_size, self.epoch,
                                  self.sequence_number, batch)
        self.sequence_number += 1
        try:
            self._stub.PublishKvEvents(request, timeout=5.0)
            if self.metrics is not None:
                self.metrics.event_lag.observe(time.monotonic() - oldest)
                self.metrics.published_events.inc(len(batch))
        except grpc.RpcError as exc:
            self.num_dropped_batches += 1
            if self.metrics is not None:
                self.metrics.dropped_batches.inc()
            now = time.monotonic()
            if now - self._last_error_log > 30:
                self._last_error_log = now
                logger.warning("kv-cache-manager unreachable, KV events dropped: %s",
                               exc.code().name)

"""Ships the scheduler's KV events to the kv-cache-manager, off the step's critical path.

The engine thread only appends to a list; this thread sends what accumulated,
at most every `interval` seconds, as one numbered batch, and a heartbeat
whenever it has been quiet for `heartbeat_interval`. A batch that cannot be
sent is dropped: the sequence number still advances, so the kv-cache-manager
sees the gap and answers `resync_required` (to a later batch or heartbeat). The
publisher then asks the engine thread for a snapshot of its cached block hashes
(`snapshot_source`) and sends it as the next batch, which replaces the index's
entries for this instance; events queued before the snapshot are superseded.

A prefill replica's lease changes (`publish_leases`) ride along in the next batch
(one is sent for them alone if no event is queued): the kv-cache-manager keeps each
live lease in Redis until it is released, reaped, or past its expiry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as pb
from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from pagoda.core.kv_events import KVEvent
from pagoda.services.common.protocol.kv_events import lease_to_proto, publish_request
from pagoda.services.common import grpc_channels
from pagoda.services.common.thread_names import KV_EVENTS, name_this_thread
from pagoda.services.common.tracing import intercept
from pagoda.services.scheduler.metrics import KvPublisherMetrics

logger = logging.getLogger(__name__)
# deliver(hashes) must be called on the engine thread between steps, with every
# block hash cached at that moment.
SnapshotSource = Callable[[Callable[[list[bytes]], None]], None]
SNAPSHOT_RETRY_S = 10.0  # ask again if a requested snapshot never came


class KvEventPublisher:
    """Invariant: batches leave in the order their events happened, numbered 0, 1, ...
    within this process's epoch; a snapshot batch supersedes everything before it."""

    def __init__(self, address: str, instance_id: str, model: str, block_size: int, epoch: str,
                 interval: float = 0.05, metrics: KvPublisherMetrics | None = None,
                 heartbeat_interval: float = 1.0,
                 snapshot_source: SnapshotSource | None = None) -> None:
        self.instance_id, self.model, self.block_size, self.epoch = (
            instance_id, model, block_size, epoch)
        self.interval = interval
        self.heartbeat_interval = heartbeat_interval
        self.snapshot_source = snapshot_source
        self.sequence_number = 0  # of the next batch
        self.num_dropped_batches = 0
        self.num_snapshots_sent = 0
        self._channel = grpc_channels.channel(address)
        self._stub = pb_grpc.KvCacheManagerServiceStub(intercept(self._channel))
        self._events: list[KVEvent] = []
        self._snapshot: list[bytes] | None = None
        self._leases_pinned: list[pb.KvLease] = []
        self._leases_released: list[str] = []
        self._oldest_event_time = 0.0  # monotonic, of the oldest queued event
        self._snapshot_asked_at: float | None = None
        self._last_contact = float("-inf")
        self.metrics = metrics
        self._cv = threading.Condition()
        self._stopped = False
        self._last_error_log = 0.0
        self._thread = threading.Thread(target=self._run, name=KV_EVENTS, daemon=True)

    def start(self) -> "KvEventPublisher":
        self._thread.start()
        return self

    # ------------------------------------------------------------ engine thread
    def publish(self, events: list[KVEvent]) -> None:
        """Queue events (called by the engine thread; never blocks on the network)."""
        with self._cv:
            if not self._events and self._snapshot is None:
                self._oldest_event_time = time.monotonic()
            self._events.extend(events)
            self._cv.notify()

    def publish_leases(self, pinned=(), released: list[str] = ()) -> None:
        """Queue lease changes: `pinned` Lease objects taken, `released` lease ids ended
        (engine thread; never blocks on the network)."""
        records = [lease_to_proto(lease) for lease in pinned]
        with self._cv:
            self._leases_pinned.extend(records)
            self._leases_released.extend(released)
            self._cv.notify()

    def publish_snapshot(self, block_hashes: list[bytes]) -> None:
        """Queue a snapshot of the whole cache (engine thread, between steps)."""
        with self._cv:
            self._events = []  # superseded: the snapshot already reflects them
            self._snapshot = list(block_hashes)
            self._oldest_event_time = time.monotonic()
            self._cv.notify()

    # ------------------------------------------------------------ lifecycle
    def stop(self, timeout: float = 5.0, deregister: bool = False) -> None:
        """Send what is queued, then stop; `deregister` also drops this instance
        from the index (a draining replica)."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout)
        if deregister:
            try:
                reply = self._stub.DeregisterInstance(pb.DeregisterInstanceRequest(
                    instance_id=self.instance_id, model=self.model, block_size=self.block_size,
                    epoch=self.epoch), timeout=timeout)
                logger.info("deregistered from the prefix index (%d blocks)", reply.num_blocks)
            except grpc.RpcError as exc:  # its heartbeat lapses instead
                logger.warning("could not deregister from the prefix index: %s",
                               exc.code().name)
        self._channel.close()

    def _run(self) -> None:
        name_this_thread(self._thread.name)
        while True:
            with self._cv:
                while not (self._events or self._snapshot is not None or self._stopped
                           or self._leases_pinned or self._leases_released):
                    wait = self._last_contact + self.heartbeat_interval - time.monotonic()
                    if wait <= 0:
                        break
                    self._cv.wait(wait)
                batch, self._events = self._events, []
                snapshot, self._snapshot = self._snapshot, None
                pinned, self._leases_pinned = self._leases_pinned, []
                released, self._leases_released = self._leases_released, []
                oldest = self._oldest_event_time if batch or snapshot is not None \
                    else time.monotonic()
                stopped = self._stopped
            if batch or snapshot is not None or pinned or released:
                self._send(batch, snapshot, oldest, pinned, released)
            elif not stopped:
                self._heartbeat()
            if stopped:
                return
            time.sleep(self.interval)  # let the next batch accumulate

    # ------------------------------------------------------------ network
    def _send(self, batch: list[KVEvent], snapshot: list[bytes] | None, oldest: float,
              pinned: list[pb.KvLease] = (), released: list[str] = ()) -> None:
        request = publish_request(self.instance_id, self.model, self.block_size, self.epoch,
                                  self.sequence_number, batch, snapshot, pinned, released)
        self.sequence_number += 1
        try:
            reply = self._stub.PublishKvEvents(request, timeout=5.0)
        except grpc.RpcError as exc:
            self.num_dropped_batches += 1
            if snapshot is not None:
                self._snapshot_asked_at = None  # the next heartbeat will ask again
            if self.metrics is not None:
                self.metrics.dropped_batches.inc()
            self._log_unreachable(exc)
            return
        self._last_contact = time.monotonic()
        if snapshot is not None:
            self.num_snapshots_sent += 1
            self._snapshot_asked_at = None
            logger.info("prefix index resynced: snapshot of %d blocks sent", len(snapshot))
        if self.metrics is not None:
            self.metrics.event_lag.observe(time.monotonic() - oldest)
            self.metrics.published_events.inc(len(batch))
        if reply.resync_required:
            self._ask_for_snapshot()

    def _heartbeat(self) -> None:
        request = pb.HeartbeatRequest(instance_id=self.instance_id, model=self.model,
                                      block_size=self.block_size, epoch=self.epoch,
                                      num_batches_sent=self.sequence_number)
        try:
            reply = self._stub.Heartbeat(request, timeout=5.0)
        except grpc.RpcError as exc:
            self._last_contact = time.monotonic()  # retry after one interval, not at once
            self._log_unreachable(exc)
            return
        self._last_contact = time.monotonic()
        if reply.resync_required:
            self._ask_for_snapshot()

    def _ask_for_snapshot(self) -> None:
        now = time.monotonic()
        if self.snapshot_source is None:
            return
        if self._snapshot_asked_at is not None and now - self._snapshot_asked_at < SNAPSHOT_RETRY_S:
            return  # one is on its way
        logger.info("prefix index lost track of this instance: taking a snapshot")
        self._snapshot_asked_at = now
        self.snapshot_source(self.publish_snapshot)

    def _log_unreachable(self, exc: grpc.RpcError) -> None:
        now = time.monotonic()
        if now - self._last_error_log > 30:
            self._last_error_log = now
            logger.warning("kv-cache-manager unreachable, KV events dropped: %s",
                           exc.code().name)

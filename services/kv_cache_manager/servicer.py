"""The kv-cache-manager's RPCs over a `PrefixIndex`."""

from __future__ import annotations

import logging
import time

import grpc
import redis

from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as pb
from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from pagoda.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagoda.services.common.protocol.kv_events import kv_event_from_proto
from pagoda.services.kv_cache_manager.index import IndexReply, PrefixIndex
from pagoda.services.kv_cache_manager.metrics import KvIndexMetrics
from pagoda.services.kv_cache_manager.response_store import RedisResponseStore, ResponseStoreError
from pagoda.services.kv_cache_manager.sequencing import Action, Reason

logger = logging.getLogger(__name__)
EVENT_KIND = {BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}


class KvCacheManagerServicer(pb_grpc.KvCacheManagerServiceServicer):
    """Redis errors become UNAVAILABLE: callers degrade (routing falls back to load,
    publishers drop the batch and resync later)."""

    def __init__(self, index: PrefixIndex, metrics: KvIndexMetrics | None = None,
                 responses: RedisResponseStore | None = None) -> None:
        self.index = index
        self.metrics = metrics
        self.responses = responses or RedisResponseStore(index.redis)

    def PublishKvEvents(self, request: pb.PublishKvEventsRequest, context: grpc.ServicerContext
                        ) -> pb.PublishKvEventsResponse:
        events = [kv_event_from_proto(e) for e in request.events]
        snapshot = list(request.snapshot_block_hashes) if request.is_snapshot else None
        start = time.perf_counter()
        try:
            reply = self.index.apply(request.model, request.block_size, request.instance_id,
                                     request.epoch, request.sequence_number, events, snapshot,
                                     request.leases_pinned, request.leases_released)
        except redis.RedisError as exc:
            self._redis_error("publish", context, exc)
        if self.metrics is not None and reply.decision.action is Action.APPLY:
            self.metrics.apply_latency.observe(time.perf_counter() - start)
            self.metrics.batches.inc()
            for event in events:
                self.metrics.events.labels(EVENT_KIND[type(event)]).inc()
        self._count(reply)
        return pb.PublishKvEventsResponse(num_blocks=reply.num_blocks,
                                          resync_required=reply.resync_required)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
                  ) -> pb.HeartbeatResponse:
        try:
            reply = self.index.heartbeat(request.model, request.block_size, request.instance_id,
                                         request.epoch, request.num_batches_sent)
        except redis.RedisError as exc:
            self._redis_error("heartbeat", context, exc)
        self._count(reply)
        return pb.HeartbeatResponse(num_blocks=reply.num_blocks,
                                    resync_required=reply.resync_required)

    def DeregisterInstance(self, request: pb.DeregisterInstanceRequest,
                           context: grpc.ServicerContext) -> pb.DeregisterInstanceResponse:
        try:
            n = self.index.deregister(request.model, request.block_size, request.instance_id,
                                      request.epoch)
        except redis.RedisError as exc:
            self._redis_error("deregister", context, exc)
        logger.info("instance %s deregistered (%d blocks dropped)", request.instance_id, n)
        if self.metrics is not None:
            self.metrics.dropped_instances.labels("deregistered").inc()
        return pb.DeregisterInstanceResponse(num_blocks=n)

    def LookupPrefix(self, request: pb.LookupPrefixRequest, context: grpc.ServicerContext
                     ) -> pb.LookupPrefixResponse:
        start = time.perf_counter()
        try:
            matches = self.index.lookup_tiers(request.model, request.block_size,
                                              list(request.block_hashes))
        except redis.RedisError as exc:
            self._redis_error("lookup", context, exc)
        if self.metrics is not None:
            self.metrics.lookup_latency.observe(time.perf_counter() - start)
        return pb.LookupPrefixResponse(
            num_cached_blocks={i: m.device for i, m in matches.items() if m.device},
            num_host_blocks={i: m.host for i, m in matches.items() if m.host},
            num_disk_blocks={i: m.disk for i, m in matches.items() if m.disk})

    def ListInstances(self, request: pb.ListInstancesRequest, context: grpc.ServicerContext
                      ) -> pb.ListInstancesResponse:
        try:
            infos = self.index.list_instances(request.model, request.block_size)
        except redis.RedisError as exc:
            self._redis_error("list", context, exc)
        return pb.ListInstancesResponse(instances=[pb.InstanceStatus(
            instance_id=i.instance_id, epoch=i.epoch, num_blocks=i.num_blocks,
            seconds_since_seen=i.seconds_since_seen, resync_pending=i.resync_pending,
            num_leases=i.num_leases)
            for i in infos])

    # ---------------------------------------------- the gateways' stored responses
    def PutStoredResponse(self, request: pb.PutStoredResponseRequest,
                          context: grpc.ServicerContext) -> pb.PutStoredResponseResponse:
        self._responses("put_response", context, self.responses.put, request.response_id,
                        request.payload, request.ttl_seconds)
        return pb.PutStoredResponseResponse()

    def GetStoredResponse(self, request: pb.GetStoredResponseRequest,
                          context: grpc.ServicerContext) -> pb.GetStoredResponseResponse:
        payload = self._responses("get_response", context, self.responses.get,
                                  request.response_id)
        if payload is None:
            return pb.GetStoredResponseResponse(found=False)
        return pb.GetStoredResponseResponse(found=True, payload=payload)

    def DeleteStoredResponse(self, request: pb.DeleteStoredResponseRequest,
                             context: grpc.ServicerContext) -> pb.DeleteStoredResponseResponse:
        deleted = self._responses("delete_response", context, self.responses.delete,
                                  request.response_id)
        return pb.DeleteStoredResponseResponse(deleted=deleted)

    def _responses(self, operation: str, context: grpc.ServicerContext, call, *args):
        try:
            return call(*args)
        except ResponseStoreError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except redis.RedisError as exc:
            self._redis_error(operation, context, exc)

    def _count(self, reply: IndexReply) -> None:
        if self.metrics is None:
            return
        if reply.restarted:
            self.metrics.resyncs.labels("restart").inc()
        reason = reply.decision.reason
        if reply.resync_required and reason is not Reason.PENDING:
            self.metrics.resyncs.labels(reason.value).inc()
            if reason is Reason.GAP:
                self.metrics.sequence_gaps.inc()

    def _redis_error(self, operation: str, context: grpc.ServicerContext, exc: Exception):
        if self.metrics is not None:
            self.metrics.redis_errors.labels(operation).inc()
        context.abort(grpc.StatusCode.UNAVAILABLE, f"redis: {exc}")

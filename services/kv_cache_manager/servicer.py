"""The kv-cache-manager's RPCs over a `PrefixIndex`."""

from __future__ import annotations

import logging

import grpc
import redis

from pagoda._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as pb
from pagoda._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from pagoda.protocol.kv_events import kv_event_from_proto
from pagoda.services.kv_cache_manager.index import PrefixIndex

logger = logging.getLogger(__name__)


class KvCacheManagerServicer(pb_grpc.KvCacheManagerServiceServicer):
    """Redis errors become UNAVAILABLE: callers degrade (routing falls back to load)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def PublishKvEvents(self, request: pb.PublishKvEventsRequest, context: grpc.ServicerContext
                        ) -> pb.PublishKvEventsResponse:
        events = [kv_event_from_proto(e) for e in request.events]
        try:
            n = self.index.apply(request.model, request.block_size, request.instance_id,
                                 request.epoch, request.sequence_number, events)
        except redis.RedisError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"redis: {exc}")
        return pb.PublishKvEventsResponse(num_blocks=n)

    def LookupPrefix(self, request: pb.LookupPrefixRequest, context: grpc.ServicerContext
                     ) -> pb.LookupPrefixResponse:
        try:
            counts = self.index.lookup(request.model, request.block_size,
                                       list(request.block_hashes))
        except redis.RedisError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"redis: {exc}")
        return pb.LookupPrefixResponse(num_cached_blocks=counts)

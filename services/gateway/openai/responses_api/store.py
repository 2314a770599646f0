"""The Responses API's memory: stored responses for `previous_response_id`, GET and DELETE.

Two stores behind one async interface (`get`, `put`, `delete`):

- `SharedResponseStore`: the cluster's Redis, through the kv-cache-manager (the
  gateway's one road to Redis). Every gateway replica reads what any replica stored,
  so a follow-up may land anywhere. Each response expires after `ttl_s`, and one
  whose JSON is over `max_bytes` is not stored (a warning; its follow-ups get 404).
  Redis being unreachable is a 503 for a lookup and a warning for a write: the answer
  the client waits for is never lost to the store.
- `MemoryResponseStore`: in this process, at most `capacity` responses, the least
  recently used one dropped first (a gateway without a kv-cache-manager).

`capacity` 0 (`--max-stored-responses 0`) stores nothing in either (each request's
`store` is then ignored, as vLLM does without its store switch).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import grpc

from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as kpb
from pagoda.services.gateway.errors import from_grpc_error

logger = logging.getLogger(__name__)
# `--max-stored-responses`'s default: a few thousand short conversations in memory.
DEFAULT_MAX_STORED_RESPONSES = 1000
# `--responses-store-ttl`: a day, then a stored response is gone from Redis.
DEFAULT_TTL_S = 24 * 3600
# `--max-stored-response-bytes`: the JSON of one response and its conversation.
DEFAULT_MAX_BYTES = 1024 * 1024
RPC_TIMEOUT_S = 5.0


@dataclass
class StoredResponse:
    """A finished response and the conversation that continues from it: the chat
    messages it was generated from (without its instructions, which a follow-up does
    not inherit, as in OpenAI's API) followed by its own answer (text, tool calls)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]

    def to_json(self) -> bytes:
        return json.dumps({"response": self.response, "messages": self.messages},
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> "StoredResponse":
        data = json.loads(payload)
        return cls(data["response"], data["messages"])


class MemoryResponseStore:
    """Invariant: `len(store) <= capacity`. Only the event loop touches it (no lock)."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if capacity < 0:
            raise ValueError(f"--max-stored-responses must be 0 or more, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    async def put(self, response_id: str, item: StoredResponse) -> None:
        if not self.enabled:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    async def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    async def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)


# The in-memory store's earlier name (tests and callers that size it directly).
ResponseStore = MemoryResponseStore


class SharedResponseStore:
    """The kv-cache-manager's Redis-backed store (`stub`: its KvCacheManagerService)."""

    def __init__(self, stub, ttl_s: int = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES,
                 enabled: bool = True) -> None:
        self.stub, self.ttl_s, self.max_bytes, self.enabled = stub, ttl_s, max_bytes, enabled

    async def put(self, response_id: str, item: StoredResponse) -> None:
        if not self.enabled:
            return
        payload = item.to_json()
        if len(payload) > self.max_bytes:
            logger.warning("response %s not stored: %d bytes is over "
                           "--max-stored-response-bytes %d", response_id, len(payload),
                           self.max_bytes)
            return
        try:
            await self.stub.PutStoredResponse(kpb.PutStoredResponseRequest(
                response_id=response_id, payload=payload, ttl_seconds=self.ttl_s),
                timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            logger.warning("response %s not stored: kv-cache-manager: %s", response_id,
                           exc.code().name if hasattr(exc, "code") else exc)

    async def get(self, response_id: str) -> StoredResponse | None:
        try:
            reply = await self.stub.GetStoredResponse(
                kpb.GetStoredResponseRequest(response_id=response_id), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise from_grpc_error(exc, "response store") from None
        return StoredResponse.from_json(reply.payload) if reply.found else None

    async def delete(self, response_id: str) -> bool:
        try:
            reply = await self.stub.DeleteStoredResponse(
                kpb.DeleteStoredResponseRequest(response_id=response_id), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise from_grpc_error(exc, "response store") from None
        return reply.deleted

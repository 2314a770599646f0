"""The gateways' stored Responses API responses, in the kv-cache-manager's Redis.

Every gateway replica reaches the same Redis through this service, so a follow-up
(`previous_response_id`) or a GET may land on any replica. Each response is one
string key, `pagoda:responses:<id>`, written with an expiry: Redis drops it when its
TTL passes, so abandoned conversations never accumulate. Invariants: no payload
over `max_bytes` is written (the gateway's cap may be lower, never higher), and no
key lives longer than `max_ttl_s`. The payload is opaque JSON here.
"""

from __future__ import annotations

import redis

KEY_PREFIX = "pagoda:responses:"
# A response and its conversation: generous for long chats, far under gRPC's 4 MiB.
DEFAULT_MAX_BYTES = 2 * 1024 * 1024
# OpenAI keeps stored responses 30 days; no key outlives that here.
MAX_TTL_S = 30 * 24 * 3600
MAX_ID_CHARS = 256


class ResponseStoreError(ValueError):
    """A request the store refuses (an over-sized payload, a malformed id)."""


class RedisResponseStore:
    def __init__(self, client: redis.Redis, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_ttl_s: int = MAX_TTL_S) -> None:
        self.redis = client
        self.max_bytes = max_bytes
        self.max_ttl_s = max_ttl_s

    def put(self, response_id: str, payload: bytes, ttl_s: int) -> None:
        if len(payload) > self.max_bytes:
            raise ResponseStoreError(f"stored response of {len(payload)} bytes is over the "
                                     f"cap of {self.max_bytes}")
        ttl = min(max(int(ttl_s), 1), self.max_ttl_s)
        self.redis.set(self._key(response_id), payload, ex=ttl)

    def get(self, response_id: str) -> bytes | None:
        return self.redis.get(self._key(response_id))

    def delete(self, response_id: str) -> bool:
        return bool(self.redis.delete(self._key(response_id)))

    @staticmethod
    def _key(response_id: str) -> str:
        if not response_id or len(response_id) > MAX_ID_CHARS:
            raise ResponseStoreError(f"response id must be 1-{MAX_ID_CHARS} characters")
        return KEY_PREFIX + response_id

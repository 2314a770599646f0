"""What the KV-aware router knows about cached prefixes.

`PrefixIndexClient` asks the kv-cache-manager for each instance's longest cached
run of a prompt's block hashes (`LookupPrefix`). The hashes come with the
prompt's tokenization (`Tokenize` returns them: the schedulers' function and
seed, checked at start-up by block_hash_check.py), so a text or chat prompt costs no
extra call; only a prompt the client sent as token ids is hashed here, through
`Tokenize` too. If either is unavailable it answers None and the router
weighs load alone; after an UNAVAILABLE or a missed deadline (a frozen index) it
does not ask again for `BACKOFF_S`, so a Redis or kv-cache-manager outage or freeze
costs no latency per request.

`RecentRoutes` covers the index's lag: the blocks of a prompt just routed to an
instance are not in the index until that instance has prefilled them and
published the events. For `TTL_S` seconds the router assumes the instance holds
them, so a burst of requests sharing a new prefix follows the first one instead
of being spread by the stale index (load still caps how many follow).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import grpc

from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as kpb
from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as kpb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.common import grpc_channels

logger = logging.getLogger(__name__)
LOOKUP_TIMEOUT_S = 0.5
BACKOFF_S = 2.0
TTL_S = 5.0
MAX_RECENT_BLOCKS = 200_000


class PrefixIndexClient:
    """The gateway's channel to the kv-cache-manager; create it inside the event loop."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc_channels.aio_channel(address)
        self.stub = kpb_grpc.KvCacheManagerServiceStub(self.channel)
        self._skip_until = 0.0
        self._last_log = 0.0

    async def lookup(self, tokenizer_stub, token_ids: Sequence[int],
                     block_hashes: Sequence[bytes] | None, cache_salt: str, model: str,
                     block_size: int, lora_key: str = ""
                     ) -> tuple[list[bytes], dict[str, int], dict[str, tuple[int, int]]] | None:
        """(the prompt's block hashes, instance id -> leading blocks in its KV cache,
        instance id -> (host-tier, disk-tier) blocks of the run that follows them), or
        None when the index cannot answer now. `block_hashes` None: hash `token_ids`
        first (with the salt and the LoRA adapter's key, as the schedulers hash them)."""
        now = time.monotonic()
        if now < self._skip_until:
            return None
        try:
            if block_hashes is None:  # a prompt sent as ids: nothing has hashed it yet
                hashed = await tokenizer_stub.Tokenize(tpb.TokenizeRequest(
                    token_ids=tpb.TokenIds(token_ids=token_ids), block_size=block_size,
                    cache_salt=cache_salt, lora_key=lora_key), timeout=LOOKUP_TIMEOUT_S)
                block_hashes = hashed.block_hashes
            hashes = list(block_hashes)
            if not hashes:
                return [], {}, {}
            reply = await self.stub.LookupPrefix(kpb.LookupPrefixRequest(
                model=model, block_size=block_size, block_hashes=hashes),
                timeout=LOOKUP_TIMEOUT_S)
        except grpc.RpcError as exc:
            self._on_error(exc, now)
            return None
        tiers = {inst: (reply.num_host_blocks.get(inst, 0), reply.num_disk_blocks.get(inst, 0))
                 for inst in {*reply.num_host_blocks, *reply.num_disk_blocks}}
        return hashes, dict(reply.num_cached_blocks), tiers

    def _on_error(self, exc: grpc.RpcError, now: float) -> None:
        code = exc.code()
        # Down (UNAVAILABLE), or hung (a frozen kv-cache-manager or Redis: the lookup ran
        # out of its deadline): stop asking for a while, so neither costs each request
        # LOOKUP_TIMEOUT_S; the first lookup after BACKOFF_S finds it back.
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._skip_until = now + BACKOFF_S
        if now - self._last_log > 30:
            self._last_log = now
            logger.warning("prefix index unavailable (%s: %s): routing by load only",
                           code.name, exc.details())

    async def close(self) -> None:
        await self.channel.close()


class RecentRoutes:
    """block hash -> {instance id: expiry}, least recently routed first; bounded."""

    def __init__(self, ttl_s: float = TTL_S, max_blocks: int = MAX_RECENT_BLOCKS) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._entries: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def record(self, block_hashes: Sequence[bytes], instance_id: str, now: float) -> None:
        expiry = now + self.ttl_s
        for h in block_hashes:
            holders = self._entries.setdefault(h, {})
            holders[instance_id] = expiry
            self._entries.move_to_end(h)
        while len(self._entries) > self.max_blocks:
            self._entries.popitem(last=False)

    def cached_blocks(self, block_hashes: Sequence[bytes], now: float) -> dict[str, int]:
        """instance id -> leading blocks of `block_hashes` recently routed to it."""
        self._expire(now)
        counts: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(block_hashes):
            holders = {inst for inst, expiry in self._entries.get(h, {}).items() if expiry > now}
            alive = holders if alive is None else alive & holders
            if not alive:
                break
            for inst in alive:
                counts[inst] = i + 1
        return counts

    def _expire(self, now: float) -> None:
        # Entries are in order of their latest record, so the front expires first.
        while self._entries:
            holders = next(iter(self._entries.values()))
            if max(holders.values()) > now:
                return
            self._entries.popitem(last=False)

"""The cluster prefix index: which scheduler instance holds which KV block, in Redis.

Keys, namespaced by model and block size (so two models, or two block sizes,
never share entries)::

    pagoda:kv:{model}:{block_size}:block:{hash hex}   SET of instance ids holding it
    pagoda:kv:{model}:{block_size}:inst:{id}:blocks   SET of hash hexes the instance holds
    pagoda:kv:{model}:{block_size}:inst:{id}:meta     HASH epoch, sequence_number, last_seen
    pagoda:kv:{model}:{block_size}:instances          SET of instance ids

Invariant: `block:h` contains instance i exactly when `inst:i:blocks` contains h
(both are written in the same pipeline), so an instance's entries can always be
dropped completely from its own block set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis

from pagoda.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)


def namespace(model: str, block_size: int) -> str:
    return f"pagoda:kv:{model}:{block_size}"


class PrefixIndex:
    """Applies KV event batches and answers longest-cached-prefix lookups."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def apply(self, model: str, block_size: int, instance_id: str, epoch: str,
              sequence_number: int, events: Sequence[KVEvent]) -> int:
        """Apply one batch in order; returns the instance's block count afterwards.

        A batch from a new epoch (the instance restarted) first drops every entry
        of the old one: its cache is gone.
        """
        ns = namespace(model, block_size)
        meta_key = f"{ns}:inst:{instance_id}:meta"
        old_epoch, old_seq = self.redis.hmget(meta_key, "epoch", "sequence_number")
        if old_epoch is not None and old_epoch.decode() != epoch:
            logger.info("instance %s restarted (epoch %s -> %s): dropping its entries",
                        instance_id, old_epoch.decode(), epoch)
            self._clear_instance(ns, instance_id)
        elif old_seq is not None and sequence_number != int(old_seq) + 1:
            # Issue 5 turns this into a resync; until then the index may drift.
            logger.warning("instance %s: KV event batch %d follows %d (events lost)",
                           instance_id, sequence_number, int(old_seq))
        pipe = self.redis.pipeline(transaction=False)
        for event in events:
            if isinstance(event, AllBlocksCleared):
                pipe.execute()
                self._clear_instance(ns, instance_id)
            elif isinstance(event, BlockStored):
                self._queue_change(pipe, ns, instance_id, event.block_hashes, add=True)
            elif isinstance(event, BlockRemoved):
                self._queue_change(pipe, ns, instance_id, event.block_hashes, add=False)
        pipe.sadd(f"{ns}:instances", instance_id)
        pipe.hset(meta_key, mapping={"epoch": epoch, "sequence_number": sequence_number,
                                     "last_seen": time.time()})
        pipe.scard(f"{ns}:inst:{instance_id}:blocks")
        return int(pipe.execute()[-1])

    def lookup(self, model: str, block_size: int, block_hashes: Sequence[bytes]
               ) -> dict[str, int]:
        """Instance id -> number of leading blocks of `block_hashes` it holds."""
        if not block_hashes:
            return {}
        ns = namespace(model, block_size)
        pipe = self.redis.pipeline(transaction=False)
        for h in block_hashes:
            pipe.smembers(f"{ns}:block:{h.hex()}")
        counts: dict[str, int] = {}
        alive: set[bytes] | None = None
        for i, members in enumerate(pipe.execute()):
            alive = set(members) if alive is None else alive & members
            if not alive:
                break
            for inst in alive:
                counts[inst.decode()] = i + 1
        return counts

    def instance_blocks(self, model: str, block_size: int, instance_id: str) -> set[bytes]:
        """Every block hash recorded for an instance."""
        members = self.redis.smembers(f"{namespace(model, block_size)}:inst:{instance_id}:blocks")
        return {bytes.fromhex(m.decode()) for m in members}

    @staticmethod
    def _queue_change(pipe, ns: str, instance_id: str, block_hashes: Sequence[bytes],
                      add: bool) -> None:
        if not block_hashes:
            return
        hexes = [h.hex() for h in block_hashes]
        blocks_key = f"{ns}:inst:{instance_id}:blocks"
        for hx in hexes:
            (pipe.sadd if add else pipe.srem)(f"{ns}:block:{hx}", instance_id)
        (pipe.sadd if add else pipe.srem)(blocks_key, *hexes)

    def _clear_instance(self, ns: str, instance_id: str) -> None:
        blocks_key = f"{ns}:inst:{instance_id}:blocks"
        hexes = [m.decode() for m in self.redis.smembers(blocks_key)]
        pipe = self.redis.pipeline(transaction=False)
        for hx in hexes:
            pipe.srem(f"{ns}:block:{hx}", instance_id)
        pipe.delete(blocks_key)
        pipe.execute()

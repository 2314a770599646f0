"""The cluster prefix index: which scheduler instance holds which KV block, in Redis.

Keys, namespaced by model and block size (so two models, or two block sizes,
never share entries)::

    pagoda:kv:{model}:{block_size}:block:{hash hex}   SET of instance ids holding it
    pagoda:kv:{model}:{block_size}:inst:{id}:blocks   SET of hash hexes the instance holds
    ...:block:{hash hex}:CPU, ...:inst:{id}:blocks:CPU  the same for its host tier
    ...:block:{hash hex}:DISK, ...:inst:{id}:blocks:DISK  and for its disk tier
    pagoda:kv:{model}:{block_size}:tiered             SET of instance ids that stored a
                                                      block in a tier (until cleared)
    pagoda:kv:{model}:{block_size}:inst:{id}:meta     HASH epoch, sequence_number, resync
    pagoda:kv:{model}:{block_size}:instances          ZSET instance id -> last seen (unix s)
    pagoda:kv:{model}:{block_size}:inst:{id}:leases   ZSET lease id -> expiry (unix s)
    pagoda:kv:{model}:{block_size}:lease:{id}:{lease} HASH request_id, block_ids,
                                                      block_hashes, expiry (expires then)
    pagoda:kv:namespaces                              SET of "{block_size}:{model}"

A block's medium (KV events' `medium`, vLLM's names) picks the pair of sets: "GPU"
(the engine's KV cache) the unsuffixed ones, "CPU" and "DISK" (the host and disk
tiers, `pagoda.core.kv_offload`) the suffixed ones. A block evicted from the device
into the host tier moves from the first pair to the second, so it stays findable one
tier lower; one onloaded back is in both.

Invariants:
  * `block:h[:M]` contains instance i exactly when `inst:i:blocks[:M]` contains h
    (both are written in the same pipeline), so an instance's entries can always be
    dropped completely from its own block sets;
  * a snapshot or AllBlocksCleared replaces every medium of the instance (the tiers
    publish their blocks again as events after a snapshot);
  * an instance with a tier entry is in `tiered` (it may stay there with none: that
    only costs its lookups a second round trip), so a cluster without tiers looks up
    the device sets alone, as before tiers;
  * an instance's batches are applied in order without holes (sequencing.py);
    otherwise it is marked `resync` and its batches are ignored until the
    snapshot it owes arrives;
  * lookups only count instances seen within `heartbeat_timeout`, and `reap`
    drops the entries of the others, so a dead instance never attracts traffic
    for longer than the timeout;
  * a lease (prefill/decode disaggregation: blocks a prefill replica pins for a
    decode replica) is recorded until its release is reported, its instance is
    dropped or restarts, or its expiry passes (the record's Redis TTL, and `reap`
    for the ZSET), so Redis never holds a lease its replica no longer holds for
    longer than the lease timeout.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from pagoda.core.kv_events import (MEDIA, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, AllBlocksCleared,
                                   BlockRemoved, BlockStored, KVEvent)
from pagoda.services.kv_cache_manager.sequencing import (Action, Decision, InstanceMeta,
                                                          decide_batch, decide_heartbeat)

logger = logging.getLogger(__name__)
NAMESPACES_KEY = "pagoda:kv:namespaces"
PIPELINE_CHUNK = 5000  # commands per pipeline round trip when copying a snapshot


def namespace(model: str, block_size: int) -> str:
    return f"pagoda:kv:{model}:{block_size}"


def _suffix(medium: str) -> str:
    """The key suffix of a medium's sets ("" for the device: the keys from before tiers)."""
    if medium in ("", MEDIUM_GPU):
        return ""
    if medium in (MEDIUM_CPU, MEDIUM_DISK):
        return f":{medium}"
    raise ValueError(f"unknown KV medium {medium!r}")


@dataclass(frozen=True)
class TierMatch:
    """What one instance holds of a prompt's leading blocks: `device` blocks in its KV
    cache, then `host` and `disk` blocks in its tiers (a scheduler onloads a run of
    tier blocks that follows its device hits, host first: kv_offload.lookup)."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk


@dataclass(frozen=True)
class IndexReply:
    """What the index did with a batch or heartbeat."""

    num_blocks: int
    decision: Decision
    restarted: bool = False  # an older epoch of the instance was dropped

    @property
    def resync_required(self) -> bool:
        return self.decision.action is Action.RESYNC


@dataclass(frozen=True)
class InstanceInfo:
    instance_id: str
    epoch: str
    num_blocks: int
    seconds_since_seen: float
    resync_pending: bool
    num_leases: int = 0


class PrefixIndex:
    """Applies KV event batches and heartbeats; answers longest-cached-prefix lookups."""

    def __init__(self, client: redis.Redis, heartbeat_timeout: float = 10.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.redis = client
        self.heartbeat_timeout = heartbeat_timeout
        self.clock = clock

    # ------------------------------------------------------------------ writes
    def apply(self, model: str, block_size: int, instance_id: str, epoch: str,
              sequence_number: int, events: Sequence[KVEvent],
              snapshot: Sequence[bytes] | None = None,
              leases_pinned: Sequence = (), leases_released: Sequence[str] = ()
              ) -> IndexReply:
        """Apply one batch (after `snapshot`, if given: the instance's whole cache).
        Lease changes (KvLease messages, lease ids) apply whatever the decision."""
        ns = namespace(model, block_size)
        meta = self._meta(ns, instance_id)
        decision = decide_batch(meta, epoch, sequence_number, snapshot is not None)
        restarted = self._drop_old_epoch(ns, instance_id, meta, epoch, decision)
        if decision.action is Action.APPLY:
            if snapshot is not None:
                if not restarted:  # a snapshot replaces whatever the index held
                    self._clear_instance(ns, instance_id)
                self._add_blocks(ns, instance_id, snapshot)
            self._apply_events(ns, instance_id, events)
            last, resync = sequence_number, False
        elif decision.action is Action.RESYNC:
            if meta is None or decision.drop_old_entries or not meta.resync_pending:
                logger.warning("instance %s: batch %d cannot be applied (%s), asking for a "
                               "snapshot", instance_id, sequence_number, decision.reason.value)
            last = -1 if decision.drop_old_entries else meta.last_sequence_number
            resync = True
        else:
            last, resync = meta.last_sequence_number, False
        n = self._register(ns, model, block_size, instance_id, epoch, last, resync)
        if leases_pinned or leases_released:
            self._apply_leases(ns, instance_id, leases_pinned, leases_released)
        return IndexReply(n, decision, restarted)

    def heartbeat(self, model: str, block_size: int, instance_id: str, epoch: str,
                  num_batches_sent: int) -> IndexReply:
        """Refresh the instance's registration; RESYNC if it has lost batches."""
        ns = namespace(model, block_size)
        meta = self._meta(ns, instance_id)
        decision = decide_heartbeat(meta, epoch, num_batches_sent)
        restarted = self._drop_old_epoch(ns, instance_id, meta, epoch, decision)
        last = -1 if decision.drop_old_entries else meta.last_sequence_number
        if decision.action is Action.RESYNC and (meta is None or not meta.resync_pending):
            logger.warning("instance %s: heartbeat says %d batches sent, index has %d (%s); "
                           "asking for a snapshot", instance_id, num_batches_sent, last + 1,
                           decision.reason.value)
        n = self._register(ns, model, block_size, instance_id, epoch, last,
                           resync=decision.action is Action.RESYNC)
        return IndexReply(n, decision, restarted)

    def deregister(self, model: str, block_size: int, instance_id: str, epoch: str) -> int:
        """Drop the instance and its entries (unless a newer epoch registered since);
        returns how many blocks it had."""
        ns = namespace(model, block_size)
        meta = self._meta(ns, instance_id)
        if meta is not None and meta.epoch != epoch:
            return 0
        return self._drop_instance(ns, instance_id)

    def reap(self) -> list[tuple[str, str]]:
        """Drop every instance not seen within the heartbeat timeout: [(model, id)]."""
        dropped = []
        cutoff = self.clock() - self.heartbeat_timeout
        for model, block_size in self.namespaces():
            ns = namespace(model, block_size)
            for raw in self.redis.zrangebyscore(f"{ns}:instances", "-inf", f"({cutoff}"):
                instance_id = raw.decode()
                # Seen again since the scan (a restarted incarnation registered, its
                # leases with it): it is alive, and dropping it would lose them.
                seen = self.redis.zscore(f"{ns}:instances", instance_id)
                if seen is None or seen >= cutoff:
                    continue
                n = self._drop_instance(ns, instance_id)
                logger.warning("instance %s of %s: no heartbeat for %.0fs, dropped its %d "
                               "blocks", instance_id, model, self.heartbeat_timeout, n)
                dropped.append((model, instance_id))
        return dropped

    # ------------------------------------------------------------------ reads
    def lookup(self, model: str, block_size: int, block_hashes: Sequence[bytes]
               ) -> dict[str, int]:
        """Live instance id -> number of leading blocks of `block_hashes` it holds."""
        if not block_hashes:
            return {}
        ns = namespace(model, block_size)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrangebyscore(f"{ns}:instances", self.clock() - self.heartbeat_timeout, "+inf")
        for h in block_hashes:
            pipe.smembers(f"{ns}:block:{h.hex()}")
        live, *members_per_block = pipe.execute()
        alive: set[bytes] = set(live)
        counts: dict[str, int] = {}
        for i, members in enumerate(members_per_block):
            alive &= members
            if not alive:
                break
            for inst in alive:
                counts[inst.decode()] = i + 1
        return counts

    def lookup_tiers(self, model: str, block_size: int, block_hashes: Sequence[bytes]
                     ) -> dict[str, TierMatch]:
        """Live instance id -> its leading run of `block_hashes`: the device hits
        first, then blocks its host or disk tier holds (host counted where both do);
        the run ends at the first block in none of them, and after the device hits a
        block only on the device also ends it (the scheduler's tier lookup would miss
        it). Instances holding none are absent."""
        if not block_hashes:
            return {}
        ns = namespace(model, block_size)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrangebyscore(f"{ns}:instances", self.clock() - self.heartbeat_timeout, "+inf")
        pipe.smembers(f"{ns}:tiered")
        for h in block_hashes:
            pipe.smembers(f"{ns}:block:{h.hex()}")
        live, tiered, *on_device = pipe.execute()
        if set(live) & tiered:  # a second round trip only where some live replica has tiers
            pipe = self.redis.pipeline(transaction=False)
            for h in block_hashes:
                pipe.smembers(f"{ns}:block:{h.hex()}:{MEDIUM_CPU}")
                pipe.smembers(f"{ns}:block:{h.hex()}:{MEDIUM_DISK}")
            in_tiers = pipe.execute()
        else:
            in_tiers = [set()] * (2 * len(block_hashes))
        members = [m for i, gpu in enumerate(on_device)
                   for m in (gpu, in_tiers[2 * i], in_tiers[2 * i + 1])]
        counts = {inst: [0, 0, 0] for inst in live}  # device, host, disk
        on_device_run = set(live)  # instances whose run has been all device so far
        walking = set(live)  # instances whose run has not ended
        for i in range(len(block_hashes)):
            on_gpu, on_cpu, on_disk = members[3 * i:3 * i + 3]
            for inst in list(walking):
                if inst in on_device_run and inst in on_gpu:
                    counts[inst][0] += 1
                    continue
                on_device_run.discard(inst)
                if inst in on_cpu:
                    counts[inst][1] += 1
                elif inst in on_disk:
                    counts[inst][2] += 1
                else:
                    walking.discard(inst)
            if not walking:
                break
        return {inst.decode(): TierMatch(*n) for inst, n in counts.items() if sum(n)}

    def leases(self, model: str, block_size: int, instance_id: str) -> dict[str, dict]:
        """The instance's live leases: lease id -> its record (request_id, block_ids,
        block_hashes as hex, expiry)."""
        ns = namespace(model, block_size)
        ids = [m.decode() for m in self.redis.zrangebyscore(
            f"{ns}:inst:{instance_id}:leases", f"({self.clock()}", "+inf")]
        pipe = self.redis.pipeline(transaction=False)
        for lease_id in ids:
            pipe.hgetall(f"{ns}:lease:{instance_id}:{lease_id}")
        out = {}
        for lease_id, raw in zip(ids, pipe.execute()):
            if raw:
                out[lease_id] = {k.decode(): v.decode() for k, v in raw.items()}
        return out

    def instance_blocks(self, model: str, block_size: int, instance_id: str) -> set[bytes]:
        """Every block hash recorded for an instance."""
        members = self.redis.smembers(f"{namespace(model, block_size)}:inst:{instance_id}:blocks")
        return {bytes.fromhex(m.decode()) for m in members}

    def list_instances(self, model: str, block_size: int) -> list[InstanceInfo]:
        """The live instances of a namespace, in id order."""
        ns = namespace(model, block_size)
        now = self.clock()
        seen = self.redis.zrangebyscore(f"{ns}:instances", now - self.heartbeat_timeout, "+inf",
                                        withscores=True)
        infos = []
        for raw, last_seen in sorted(seen):
            instance_id = raw.decode()
            meta = self._meta(ns, instance_id)
            infos.append(InstanceInfo(
                instance_id, meta.epoch if meta else "",
                self.redis.scard(f"{ns}:inst:{instance_id}:blocks"), now - last_seen,
                meta.resync_pending if meta else False,
                self.redis.zcount(f"{ns}:inst:{instance_id}:leases", f"({now}", "+inf")))
        return infos

    def namespaces(self) -> list[tuple[str, int]]:
        """Every (model, block_size) the index has seen."""
        out = []
        for raw in self.redis.smembers(NAMESPACES_KEY):
            size, _, model = raw.decode().partition(":")
            out.append((model, int(size)))
        return sorted(out)

    # ------------------------------------------------------------------ helpers
    def _drop_old_epoch(self, ns: str, instance_id: str, meta: InstanceMeta | None, epoch: str,
                        decision: Decision) -> bool:
        """Forget a restarted instance's old cache; True if there was one."""
        if not decision.drop_old_entries or meta is None:
            return False
        n = self._clear_instance(ns, instance_id)
        self._drop_leases(ns, instance_id)  # an old incarnation's blocks are gone
        logger.info("instance %s: epoch %s -> %s, dropped its %d old entries", instance_id,
                    meta.epoch, epoch, n)
        return True

    def _meta(self, ns: str, instance_id: str) -> InstanceMeta | None:
        epoch, seq, resync = self.redis.hmget(f"{ns}:inst:{instance_id}:meta", "epoch",
                                              "sequence_number", "resync")
        if epoch is None:
            return None
        return InstanceMeta(epoch.decode(), int(seq or -1), resync == b"1")

    def _register(self, ns: str, model: str, block_size: int, instance_id: str, epoch: str,
                  last_sequence_number: int, resync: bool) -> int:
        pipe = self.redis.pipeline(transaction=False)
        pipe.sadd(NAMESPACES_KEY, f"{block_size}:{model}")
        pipe.zadd(f"{ns}:instances", {instance_id: self.clock()})
        pipe.hset(f"{ns}:inst:{instance_id}:meta", mapping={
            "epoch": epoch, "sequence_number": last_sequence_number, "resync": int(resync)})
        pipe.scard(f"{ns}:inst:{instance_id}:blocks")
        return int(pipe.execute()[-1])

    def _apply_events(self, ns: str, instance_id: str, events: Sequence[KVEvent]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for event in events:
            if not isinstance(event, AllBlocksCleared) and event.medium not in ("", *MEDIA):
                logger.warning("instance %s: KV event of unknown medium %r ignored",
                               instance_id, event.medium)
                continue
            if isinstance(event, AllBlocksCleared):
                pipe.execute()
                self._clear_instance(ns, instance_id)
            elif isinstance(event, BlockStored):
                _queue_change(pipe, ns, instance_id, event.block_hashes, add=True,
                              medium=event.medium)
                if event.medium in (MEDIUM_CPU, MEDIUM_DISK) and event.block_hashes:
                    pipe.sadd(f"{ns}:tiered", instance_id)
            elif isinstance(event, BlockRemoved):
                _queue_change(pipe, ns, instance_id, event.block_hashes, add=False,
                              medium=event.medium)
        pipe.execute()

    def _add_blocks(self, ns: str, instance_id: str, block_hashes: Sequence[bytes]) -> None:
        for start in range(0, len(block_hashes), PIPELINE_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            _queue_change(pipe, ns, instance_id, block_hashes[start:start + PIPELINE_CHUNK],
                          add=True)
            pipe.execute()

    def _clear_instance(self, ns: str, instance_id: str) -> int:
        """Drop the instance's entries of every medium; returns its device blocks."""
        n_device = 0
        for medium in MEDIA:
            suffix = _suffix(medium)
            blocks_key = f"{ns}:inst:{instance_id}:blocks{suffix}"
            hexes = [m.decode() for m in self.redis.smembers(blocks_key)]
            for start in range(0, len(hexes), PIPELINE_CHUNK):
                pipe = self.redis.pipeline(transaction=False)
                for hx in hexes[start:start + PIPELINE_CHUNK]:
                    pipe.srem(f"{ns}:block:{hx}{suffix}", instance_id)
                pipe.execute()
            self.redis.delete(blocks_key)
            if medium == MEDIUM_GPU:
                n_device = len(hexes)
        self.redis.srem(f"{ns}:tiered", instance_id)
        return n_device

    def _apply_leases(self, ns: str, instance_id: str, pinned: Sequence,
                      released: Sequence[str]) -> None:
        leases_key = f"{ns}:inst:{instance_id}:leases"
        pipe = self.redis.pipeline(transaction=False)
        for lease in pinned:
            if not lease.lease_id or not math.isfinite(lease.expiry) or lease.expiry <= 0:
                continue  # malformed: nothing to record (the sender's bug, not ours to fail)
            key = f"{ns}:lease:{instance_id}:{lease.lease_id}"
            pipe.hset(key, mapping={
                "request_id": lease.request_id,
                "block_ids": ",".join(map(str, lease.block_ids)),
                "block_hashes": ",".join(h.hex() for h in lease.block_hashes),
                "expiry": repr(lease.expiry)})
            pipe.expireat(key, int(lease.expiry) + 1)
            pipe.zadd(leases_key, {lease.lease_id: lease.expiry})
        for lease_id in released:
            pipe.delete(f"{ns}:lease:{instance_id}:{lease_id}")
            pipe.zrem(leases_key, lease_id)
        pipe.zremrangebyscore(leases_key, "-inf", self.clock())  # past their expiry
        pipe.execute()

    def _drop_leases(self, ns: str, instance_id: str) -> int:
        leases_key = f"{ns}:inst:{instance_id}:leases"
        ids = [m.decode() for m in self.redis.zrange(leases_key, 0, -1)]
        pipe = self.redis.pipeline(transaction=False)
        for lease_id in ids:
            pipe.delete(f"{ns}:lease:{instance_id}:{lease_id}")
        pipe.delete(leases_key)
        pipe.execute()
        return len(ids)

    def _drop_instance(self, ns: str, instance_id: str) -> int:
        self._drop_leases(ns, instance_id)
        n = self._clear_instance(ns, instance_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrem(f"{ns}:instances", instance_id)
        pipe.delete(f"{ns}:inst:{instance_id}:meta")
        pipe.execute()
        return n


def _queue_change(pipe, ns: str, instance_id: str, block_hashes: Sequence[bytes],
                  add: bool, medium: str = MEDIUM_GPU) -> None:
    if not block_hashes:
        return
    suffix = _suffix(medium)
    hexes = [h.hex() for h in block_hashes]
    for hx in hexes:
        (pipe.sadd if add else pipe.srem)(f"{ns}:block:{hx}{suffix}", instance_id)
    (pipe.sadd if add else pipe.srem)(f"{ns}:inst:{instance_id}:blocks{suffix}", *hexes)

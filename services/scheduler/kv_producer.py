"""The prefill side of disaggregation: lease a finished prompt's blocks, answer with
where they are, free them when the decode side is done or nobody came.

    Generate(do_remote_decode) ─► prefill, first token ─► finish ─► pin blocks (lease)
        ─► complete{kv_transfer_params: blocks, lease, expiry, worker address, epochs}
    ReleaseLease(lease, epoch) ─► blocks back to the pool (valid: they were held)
    reaper, every second       ─► leases past --kv-lease-timeout freed
    a failed step (KV re-allocated as zeros) ─► every lease dropped (`on_kv_reset`):
        ReleaseLease answers not valid, and the worker's new epoch refuses their pulls
    LeasePrefix(hashes, tokens) ─► the leading run still cached, pinned under a lease
        (another replica pulls it instead of computing it: the gateway's --kv-prefix-pull);
        with from_tier the run continues into the host/disk KV tiers, onloaded first
        (kv_tier_lease.py)

The pin happens on the engine thread in the same step that freed the request's
blocks (the outputs callback runs before the next step), so they are still cached:
nothing can reuse them between the request's end and its lease.

Every lease taken and ended goes to `lease_journal` (the KV event publisher), so the
kv-cache-manager keeps the cluster's live leases in Redis, next to the prefix index.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc

from pagoda.core.block_hash import DEFAULT_HASH_ALGO, hash_request_tokens, request_keys
from pagoda.kv_transfer.leases import LeaseTable
from pagoda.kv_transfer.params import KVTransferParams
from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as pb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as pb_grpc
from pagoda.services.common.kv_transfer_metrics import kv_transfer_metrics
from pagoda.services.common.protocol.kv_transfer import kv_params_to_proto
from pagoda.services.scheduler.kv_tier_lease import lease_from_tier

logger = logging.getLogger(__name__)
REAP_INTERVAL_S = 1.0


class KvProducer:
    """Invariant: a request registered by `expect` either gets a lease on its
    finished output (when it ended by length after its prompt, with at least one
    full cached block) or none; every lease ends by `release` or by the reaper."""

    def __init__(self, engine, pool, info, scheduler_address: str, worker_address: str,
                 worker_epoch: str, lease_timeout_s: float) -> None:
        self.engine = engine
        self.table = LeaseTable(pool, lease_timeout_s)
        self.info = info  # GetModelInfoResponse: instance id, epoch, block size, seed
        self.scheduler_address = scheduler_address
        self.worker_address = worker_address
        self.worker_epoch = worker_epoch
        self._lock = threading.Lock()
        self._expected: dict[str, tuple[list[bytes], list[int]]] = {}
        # request id -> its lease, until the request's stream ends (engine thread only)
        self._undelivered: dict[str, str] = {}
        # internal tier-onload request id -> its kv_tier_lease.TierWaiter (under _lock)
        self._waiters: dict[str, object] = {}
        # (pinned leases, ended lease ids) -> None; called on the engine thread, must
        # not block (KvEventPublisher.publish_leases queues them).
        self.lease_journal = lambda pinned, released: None
        kv_transfer_metrics()  # exported (at 0) from start-up, not from the first failure

    def expect(self, request: EngineCoreRequest) -> None:
        """Called before the request is submitted: lease its blocks when it finishes."""
        hashes = hash_request_tokens(request.prompt_token_ids, self.info.block_size,
                                     self.info.prefix_hash_seed,
                                     request_keys(request.cache_salt, request.lora_key),
                                     algo=self.info.prefix_caching_hash_algo or DEFAULT_HASH_ALGO,
                                     mm_features=request.mm_features)  # the engine's keys
        with self._lock:
            self._expected[request.request_id] = (hashes, list(request.prompt_token_ids))

    def forget(self, request_id: str, delivered: bool = True) -> None:
        """The request's stream ended; unless its last output (naming its lease) was
        `delivered`, the caller left without learning the lease: it ends now."""
        with self._lock:
            self._expected.pop(request_id, None)
        # Queued on the engine thread: behind an `on_outputs` pinning the lease now.
        self.engine.call_soon(lambda: self._settle(request_id, delivered))

    def _settle(self, request_id: str, delivered: bool) -> None:
        lease_id = self._undelivered.pop(request_id, None)
        if lease_id is not None and not delivered:
            self._release(lease_id)

    def await_lease(self, request_id: str, waiter) -> None:
        """Called before the internal tier-onload request `request_id` is submitted:
        when it finishes, lease its blocks and hand the lease to `waiter.deliver`
        (kv_tier_lease.py)."""
        with self._lock:
            self._waiters[request_id] = waiter

    def drop_waiter(self, request_id: str, waiter) -> None:
        """Engine thread: the tier lease's caller left (or its request was refused):
        forget it, releasing the lease made for it if it was delivered already (both
        run on this thread: no lease is made for it after this)."""
        with self._lock:
            self._waiters.pop(request_id, None)
        if waiter.lease_id is not None:
            self._release(waiter.lease_id)

    def _deliver_tier_lease(self, out: EngineCoreOutput, waiter) -> None:
        """Engine thread: `out` finished an internal tier-onload request; pin the run."""
        params = None
        if out.finish_reason != FinishReason.ABORT:
            params = self.lease_prefix(out.request_id, waiter.hashes, waiter.tokens,
                                       waiter.min_blocks)
        if params is not None:
            waiter.lease_id = params.lease_id
            kv_transfer_metrics().tier_lease_blocks.inc(waiter.num_tier_blocks)
        waiter.deliver(params)

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Engine thread, right after the step that finished these requests."""
        for out in outputs:
            if not out.finished:
                continue
            with self._lock:
                expected = self._expected.pop(out.request_id, None)
                waiter = self._waiters.pop(out.request_id, None)
            if waiter is not None:
                self._deliver_tier_lease(out, waiter)
                continue
            if expected is None or out.finish_reason == FinishReason.ABORT:
                continue
            lease = self.table.pin(out.request_id, *expected)
            if lease is None:
                continue
            self.lease_journal([lease], [])
            out.kv_transfer_params = self._params(lease, out.num_cached_tokens)
            self._undelivered[out.request_id] = lease.lease_id  # until its stream ends
        kv_transfer_metrics().leased_blocks.set(self.table.num_leased_blocks)

    def lease_prefix(self, request_id: str, block_hashes: list[bytes], token_ids: list[int],
                     min_blocks: int) -> KVTransferParams | None:
        """Engine thread: lease the leading run of `block_hashes` cached here (their
        tokens checked), or nothing when the run is shorter than `min_blocks` (evicted
        since the index said otherwise: not worth a pull)."""
        lease = self.table.pin(request_id, block_hashes, token_ids)
        if lease is not None and len(lease.blocks) < max(1, min_blocks):
            self.table.release(lease.lease_id)  # never journaled: nobody saw it
            lease = None
        if lease is None:
            return None
        self.lease_journal([lease], [])
        kv_transfer_metrics().leased_blocks.set(self.table.num_leased_blocks)
        return self._params(lease, len(lease.blocks) * self.info.block_size)

    def _params(self, lease, num_cached_tokens: int) -> KVTransferParams:
        """Where `lease`'s blocks are, for a decode replica to pull them."""
        return KVTransferParams(
            remote_instance_id=self.info.instance_id,
            remote_scheduler_address=self.scheduler_address,
            remote_worker_address=self.worker_address, remote_epoch=self.info.epoch,
            remote_worker_epoch=self.worker_epoch, lease_id=lease.lease_id,
            lease_expiry=lease.expiry, block_hashes=list(lease.block_hashes),
            remote_block_ids=lease.block_ids, num_cached_tokens=num_cached_tokens)

    async def on_engine(self, fn):
        """Run `fn` on the engine thread; its result."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def call() -> None:
            result = fn()
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

        self.engine.call_soon(call)
        return await asyncio.wait_for(done, timeout=30.0)

    def on_kv_reset(self, worker_epoch: str | None) -> None:
        """Engine thread, once the worker's KV cache was set up again after a failed
        step: the leased blocks hold zeros now, so every lease ends (a decode replica
        that pulled one is told not valid and recomputes), and new leases name the
        worker's new epoch (None: unknown; pulls naming the old one are refused)."""
        dropped = self.table.invalidate()
        if dropped:
            self.lease_journal([], [lease.lease_id for lease in dropped])
            logger.warning("KV cache set up again: %d lease(s) ended", len(dropped))
        if worker_epoch:
            self.worker_epoch = worker_epoch
        kv_transfer_metrics().leased_blocks.set(self.table.num_leased_blocks)

    def _release(self, lease_id: str) -> bool:
        valid = self.table.release(lease_id)
        if valid:
            self.lease_journal([], [lease_id])
        kv_transfer_metrics().leased_blocks.set(self.table.num_leased_blocks)
        return valid

    def _reap(self) -> None:
        expired = self.table.reap()
        if expired:
            self.lease_journal([], [lease.lease_id for lease in expired])
        for lease in expired:
            logger.warning("lease %s of request %s expired unclaimed: %d blocks freed",
                           lease.lease_id, lease.request_id, len(lease.blocks))
            kv_transfer_metrics().failures.labels("lease_expired").inc()
        kv_transfer_metrics().leased_blocks.set(self.table.num_leased_blocks)

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(min(REAP_INTERVAL_S, self.table.timeout_s / 4))
            if self.table.leases:
                self.engine.call_soon(self._reap)


class KvLeaseServicer(pb_grpc.KvLeaseServiceServicer):
    def __init__(self, producer: KvProducer) -> None:
        self.producer = producer

    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context
                           ) -> pb.ReleaseLeaseResponse:
        if request.epoch != self.producer.info.epoch:
            return pb.ReleaseLeaseResponse(valid=False)  # a previous incarnation's lease
        lease_id = request.lease_id
        try:
            valid = await self.producer.on_engine(lambda: self.producer._release(lease_id))
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine did not answer")
        return pb.ReleaseLeaseResponse(valid=valid)

    async def LeasePrefix(self, request: pb.LeasePrefixRequest, context
                          ) -> pb.LeasePrefixResponse:
        producer = self.producer
        hashes, tokens = list(request.block_hashes), list(request.token_ids)
        if len(tokens) != len(hashes) * producer.info.block_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(tokens)} tokens for {len(hashes)} blocks of "
                                f"{producer.info.block_size}")
        rid, min_blocks = request.request_id, request.min_blocks
        if request.from_tier:  # onload what the tiers hold first (kv_tier_lease.py)
            params, num_tier = await lease_from_tier(producer, rid, hashes, tokens,
                                                     min_blocks, request.cache_salt)
            reply = pb.LeasePrefixResponse(num_tier_blocks=num_tier)
            if params is not None:
                kv_params_to_proto(params, reply.kv_transfer_params)
            return reply
        made: list[KVTransferParams] = []

        def lease() -> KVTransferParams | None:
            params = producer.lease_prefix(rid, hashes, tokens, min_blocks)
            made.extend([params] if params is not None else [])
            return params

        try:
            params = await producer.on_engine(lease)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine did not answer")
        except asyncio.CancelledError:
            # The caller gave up (its deadline): free what the engine thread leases
            # anyway, queued behind the leasing itself.
            producer.engine.call_soon(lambda: made and producer._release(made[0].lease_id))
            raise
        reply = pb.LeasePrefixResponse()
        if params is not None:
            kv_params_to_proto(params, reply.kv_transfer_params)
        return reply

    async def ListLeases(self, request, context) -> pb.ListLeasesResponse:
        table = self.producer.table
        ids, num = await self.producer.on_engine(
            lambda: (list(table.leases), table.num_leased_blocks))
        return pb.ListLeasesResponse(lease_ids=ids, num_leased_blocks=num)

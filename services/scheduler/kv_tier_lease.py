"""A peer's prefix lease served from this replica's host/disk KV tiers (`LeasePrefix`
with `from_tier`: the gateway's --kv-prefix-pull chose this replica for a prefix it
holds partly in a tier).

    LeasePrefix(hashes, tokens, from_tier) ─► engine thread: device run d, tier run t
       t == 0 ──────────────────────────────► the device lease, as without from_tier
       d + t < min_blocks ──────────────────► no lease (too_few_blocks)
       else ─► an internal request: the d + t blocks' tokens and one more, max_tokens 1
               ─► the normal path: asynchronous onload of the tier blocks
                  (WAITING_FOR_REMOTE_KVS), one token computed, finished
               ─► pinned on the engine thread in the step that finished it (as a P/D
                  prefill's lease) ─► the device lease the peer pulls as before

Why an internal request rather than a pull served out of the host tier: every piece is
the engine's own and already tested: the tier index's holds, the worker's verified
copies (a slot that fails its hash or CRC, evicted or corrupt, is recomputed by this
replica, so the leased KV is right), the device lease and its reaper, the worker's
epoch checks and the pull. A pull out of the tier would need a second lease kind that
pins host slots and disk records in the scheduler's index, and a second read path in
the worker's PullBlocks for each medium. The cost: the blocks pass through this
replica's device (one onload, the same bytes a local revisit would move) and one token
is computed (the extra token: every block of the run is then a full, cacheable block
before the prompt's last token; its value never matters, blocks before it do not read it).

Isolation: the internal request is hashed by the engine's own rule from the tokens and
the caller's cache_salt (a LoRA or multimodal prompt never asks: the gateway sends
those device-only), and is refused unless those hashes equal the caller's; the tier
lookups and the lease then go by those hashes and check every block's tokens, as any
lease does. Nothing here can fail the peer's request: any refusal, failure or a caller
that gave up (its deadline) ends in no lease, and the peer computes the prompt.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pagoda.core.block_hash import DEFAULT_HASH_ALGO, hash_request_tokens, request_keys
from pagoda.kv_transfer.params import KVTransferParams
from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from pagoda.services.common.kv_transfer_metrics import kv_transfer_metrics

logger = logging.getLogger(__name__)
ONLOAD_SUFFIX = ".tier-onload"


@dataclass
class TierWaiter:
    """One internal onload request's lease, delivered on the engine thread."""

    hashes: list[bytes]
    tokens: list[int]
    min_blocks: int
    num_tier_blocks: int
    deliver: object  # (KVTransferParams | None) -> None, called on the engine thread
    lease_id: str | None = None  # the lease made for it (to release if its caller left)


def held_runs(core, hashes: list[bytes], tokens: list[int], block_size: int
              ) -> tuple[int, int]:
    """Engine thread: (leading blocks on the device, blocks right after them in the
    tiers). Pins and counts nothing."""
    pool = core.scheduler.kv_cache_manager.pool
    device = 0
    while device < len(hashes) and pool.get_cached_block(
            hashes[device], tokens[device * block_size:(device + 1) * block_size]) is not None:
        device += 1
    index = core.scheduler.kv_offload
    tier = index.held_run(hashes, tokens, device, block_size) if index is not None else 0
    return device, tier


def onload_request(request_id: str, tokens: list[int], num_blocks: int, block_size: int,
                   cache_salt: str | None) -> EngineCoreRequest:
    """The internal request whose prefill onloads `num_blocks` leading blocks: their
    tokens and one more (a copy of the last: its KV is never leased), one output token."""
    prompt = list(tokens[:num_blocks * block_size])
    return EngineCoreRequest(request_id + ONLOAD_SUFFIX, prompt + prompt[-1:],
                             SamplingParams(max_tokens=1, temperature=0.0),
                             cache_salt=cache_salt or None)


def request_hashes(request: EngineCoreRequest, info) -> list[bytes]:
    """`request`'s block hashes by the engine's rule (KvProducer.expect's)."""
    return hash_request_tokens(request.prompt_token_ids, info.block_size,
                               info.prefix_hash_seed,
                               request_keys(request.cache_salt, request.lora_key),
                               algo=info.prefix_caching_hash_algo or DEFAULT_HASH_ALGO)


async def lease_from_tier(producer, request_id: str, hashes: list[bytes], tokens: list[int],
                          min_blocks: int, cache_salt: str
                          ) -> tuple[KVTransferParams | None, int]:
    """The lease of the leading run this replica holds on its device and in its tiers,
    onloading the tier part first, and how many of its blocks came from the tiers;
    (None, 0) when it holds fewer than `min_blocks` or the onload failed. Cancelled (the caller's deadline): the onload is aborted and a lease
    made meanwhile released."""
    bs = producer.info.block_size
    metrics = kv_transfer_metrics()

    def plan():
        device, tier = held_runs(producer.engine.core, hashes, tokens, bs)
        if tier == 0:  # nothing in the tiers beyond the device run: lease that
            return "device", producer.lease_prefix(request_id, hashes, tokens, min_blocks)
        return "onload", (device, tier)

    kind, value = await producer.on_engine(plan)
    if kind == "device":
        return value, 0
    device, tier = value
    num_blocks = device + tier
    if num_blocks < max(1, min_blocks):
        metrics.tier_leases.labels("too_few_blocks").inc()
        return None, 0
    request = onload_request(request_id, tokens, num_blocks, bs, cache_salt)
    if request_hashes(request, producer.info)[:num_blocks] != hashes[:num_blocks]:
        # Another salt (or a prompt hashed with keys this request lacks): never onload
        # or lease blocks under hashes the caller did not name.
        logger.warning("prefix lease %s: the tier onload's block hashes differ from the "
                       "caller's; not leasing", request_id)
        metrics.tier_leases.labels("failed").inc()
        return None, 0
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def deliver(params: KVTransferParams | None) -> None:  # engine thread
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(params))

    rid = request.request_id
    waiter = TierWaiter(hashes[:num_blocks], tokens[:num_blocks * bs], min_blocks, tier,
                        deliver)
    producer.await_lease(rid, waiter)
    accepted: asyncio.Future = loop.create_future()
    producer.engine.submit(request, lambda error: loop.call_soon_threadsafe(
        lambda: accepted.done() or accepted.set_result(error)))
    try:
        error = await accepted
        if error is not None:
            logger.info("prefix lease %s: the tier onload was refused (%s)", request_id, error)
            producer.engine.call_soon(lambda: producer.drop_waiter(rid, waiter))
            metrics.tier_leases.labels("failed").inc()
            return None, 0
        params = await done
    except asyncio.CancelledError:
        producer.engine.abort([rid])
        producer.engine.call_soon(lambda: producer.drop_waiter(rid, waiter))
        metrics.tier_leases.labels("failed").inc()
        raise
    metrics.tier_leases.labels("leased" if params is not None else "failed").inc()
    return params, (tier if params is not None else 0)

"""The two scheduler halves of a prefix pull (the gateway's --kv-prefix-pull) on the CPU:
LeasePrefix leases the leading run still cached (tokens checked), or nothing below
min_blocks; KvConsumer.prepare pulls a lease that covers only a prefix of the prompt
(no first token, as after a P/D prefill), skipping what it holds, and the request then
finds the whole run as a prefix-cache hit."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagoda.core.block_hash import hash_request_tokens, request_keys
from pagoda.core.block_pool import BlockPool
from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as pb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services.common.protocol.kv_transfer import kv_params_from_proto
from pagoda.services.scheduler.kv_consumer import KvConsumer
from pagoda.services.scheduler.kv_producer import KvLeaseServicer, KvProducer

BS = 4
SEED = "seed"
PROMPT = list(range(100, 118))  # 4 full blocks and 2 tokens
HASHES = hash_request_tokens(PROMPT, BS, SEED, request_keys(None, None))


class InlineEngine:
    """The engine thread, run inline: `call_soon` calls at once, in order."""

    def call_soon(self, fn) -> None:
        fn()


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details):
        raise Aborted(code, details)


def info(instance: str) -> spb.GetModelInfoResponse:
    return spb.GetModelInfoResponse(instance_id=instance, epoch=f"{instance}-epoch",
                                    block_size=BS, prefix_hash_seed=SEED)


def pool_holding(num_blocks: int) -> BlockPool:
    """A pool whose cache holds the prompt's first `num_blocks` blocks, freed."""
    pool = BlockPool(16, BS, enable_caching=True)
    if num_blocks:
        blocks = pool.get_new_blocks(num_blocks)
        pool.cache_full_blocks(blocks, HASHES, PROMPT, 0, num_blocks)
        pool.free_blocks(reversed(blocks))
    return pool


def producer(pool: BlockPool) -> KvProducer:
    return KvProducer(InlineEngine(), pool, info("s"), "s-scheduler:1", "s-worker:1",
                      "s-worker-epoch", lease_timeout_s=30.0)


def lease(servicer: KvLeaseServicer, num_blocks: int, min_blocks: int) -> pb.LeasePrefixResponse:
    return asyncio.run(servicer.LeasePrefix(pb.LeasePrefixRequest(
        request_id="r.prefix", block_hashes=HASHES[:num_blocks],
        token_ids=PROMPT[:num_blocks * BS], min_blocks=min_blocks), Context()))


def test_lease_prefix_pins_the_leading_run_still_cached():
    pool = pool_holding(3)  # the index may say 4: the 4th was evicted since
    source = producer(pool)
    reply = lease(KvLeaseServicer(source), 4, 2)
    params = kv_params_from_proto(reply.kv_transfer_params)
    assert params.block_hashes == HASHES[:3] and len(params.remote_block_ids) == 3
    assert params.num_cached_tokens == 3 * BS and params.lease_id
    assert (params.remote_scheduler_address, params.remote_worker_address,
            params.remote_epoch, params.remote_worker_epoch) == \
        ("s-scheduler:1", "s-worker:1", "s-epoch", "s-worker-epoch")
    assert source.table.num_leased_blocks == 3 and pool.num_free_blocks == 13
    assert source.table.release(params.lease_id) and pool.num_free_blocks == 16


def test_lease_prefix_pins_nothing_below_min_blocks():
    pool = pool_holding(2)
    source = producer(pool)
    journal = []
    source.lease_journal = lambda pinned, released: journal.append((pinned, released))
    assert not lease(KvLeaseServicer(source), 4, 3).HasField("kv_transfer_params")
    assert source.table.num_leased_blocks == 0 and pool.num_free_blocks == 16
    assert journal == []  # nothing reached Redis
    assert not lease(KvLeaseServicer(producer(pool_holding(0))), 4, 1).HasField(
        "kv_transfer_params")


def test_lease_prefix_checks_the_tokens():
    servicer = KvLeaseServicer(producer(pool_holding(4)))
    with pytest.raises(Aborted) as refused:
        asyncio.run(servicer.LeasePrefix(pb.LeasePrefixRequest(
            request_id="r", block_hashes=HASHES[:2], token_ids=PROMPT[:7]), Context()))
    assert refused.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    # Right count, other tokens (a hash collision): nothing is leased.
    reply = asyncio.run(servicer.LeasePrefix(pb.LeasePrefixRequest(
        request_id="r", block_hashes=HASHES[:2], token_ids=[1] * 8, min_blocks=1), Context()))
    assert not reply.HasField("kv_transfer_params")


class Worker:
    """The consumer's own gpu-worker: records the FetchBlocks it is asked for."""

    def __init__(self) -> None:
        self.fetches: list[pb.FetchBlocksRequest] = []

    async def FetchBlocks(self, request, timeout):
        self.fetches.append(request)
        return pb.FetchBlocksResponse(num_blocks=len(request.local_block_ids))


class LeaseService:
    def __init__(self, source: KvProducer) -> None:
        self.servicer = KvLeaseServicer(source)

    async def ReleaseLease(self, request, timeout):
        return await self.servicer.ReleaseLease(request, Context())


def test_a_prefix_only_lease_is_pulled_minus_what_is_held_and_hits():
    source = producer(pool_holding(4))
    params = kv_params_from_proto(lease(KvLeaseServicer(source), 3, 2).kv_transfer_params)
    params.do_remote_prefill = True
    pool = pool_holding(1)  # the target holds block 0 already
    request = EngineCoreRequest("r", list(PROMPT), SamplingParams(max_tokens=4),
                                kv_transfer_params=params)
    worker = Worker()

    async def prepare() -> KvConsumer:
        consumer = KvConsumer(InlineEngine(), pool, info("r"), "127.0.0.1:1", 5.0)
        consumer.worker = worker
        consumer._lease_stubs["s-scheduler:1"] = LeaseService(source)
        await consumer.prepare(request)
        return consumer

    consumer = asyncio.run(prepare())
    assert request.kv_transfer_params is None  # consumed: the engine never sees them
    [fetch] = worker.fetches
    assert list(fetch.remote_block_ids) == params.remote_block_ids[1:3]  # block 0 held here
    assert source.table.num_leased_blocks == 0  # released after the pull
    hits = [pool.get_cached_block(h, PROMPT[i * BS:(i + 1) * BS]) for i, h in enumerate(HASHES)]
    assert [b is not None for b in hits] == [True, True, True, False]
    assert sorted(b.block_id for b in hits[1:3]) == sorted(fetch.local_block_ids)
    consumer.finish("r")  # the plan's references dropped: every block evictable again
    assert pool.num_free_blocks == 16


def test_an_error_on_the_engine_thread_reaches_the_awaiting_handler():
    """A plan that raises on the engine thread fails the handler's await with that error
    (it used to be lost, leaving the handler waiting forever)."""

    def fail():
        raise ValueError("no room")

    async def run():
        consumer = KvConsumer(InlineEngine(), pool_holding(1), info("r"), "127.0.0.1:1", 5.0)
        return await asyncio.wait_for(consumer.on_engine(fail), 5)

    with pytest.raises(ValueError, match="no room"):
        asyncio.run(run())


# ------------------------------------------------------------------ from a source's tier
class TierEngine(InlineEngine):
    """A source's engine: its pool, its host tier's index (`kv_offload`), and a
    `submit` that plays the internal onload request's life: its blocks come up from the
    tier into the device cache and it finishes (unless `finish` is False)."""

    def __init__(self, pool: BlockPool, tier_blocks: range, finish: bool = True) -> None:
        from pagoda.core.kv_offload import KVOffloadIndex

        tier = KVOffloadIndex(8, 64)
        for i in tier_blocks:
            tier.offload(i, HASHES[i], tuple(PROMPT[i * BS:(i + 1) * BS]))

        class Scheduler:
            kv_cache_manager = type("Manager", (), {"pool": pool})
            kv_offload = tier

        self.core = type("Core", (), {"scheduler": Scheduler})
        self.pool, self.finish = pool, finish
        self.producer: KvProducer | None = None
        self.submitted: list[EngineCoreRequest] = []
        self.aborted: list[str] = []

    def submit(self, request, on_accept) -> None:
        self.submitted.append(request)
        on_accept(None)
        if self.finish:
            self.run(request)

    def run(self, request) -> None:
        from pagoda.messages import EngineCoreOutput, FinishReason

        n = len(request.prompt_token_ids) // BS
        blocks = self.pool.get_new_blocks(n)
        hashes = hash_request_tokens(request.prompt_token_ids, BS, SEED,
                                     request_keys(request.cache_salt, None))
        self.pool.cache_full_blocks(blocks, hashes, request.prompt_token_ids, 0, n)
        self.pool.free_blocks(reversed(blocks))
        self.producer.on_outputs([EngineCoreOutput(request.request_id, [5],
                                                   finish_reason=FinishReason.LENGTH)])

    def abort(self, request_ids) -> None:
        self.aborted.extend(request_ids)


def tier_source(device_blocks: int, tier_blocks: range, finish: bool = True):
    pool = pool_holding(device_blocks)
    engine = TierEngine(pool, tier_blocks, finish)
    source = KvProducer(engine, pool, info("s"), "s-scheduler:1", "s-worker:1",
                        "s-worker-epoch", lease_timeout_s=30.0)
    engine.producer = source
    return source, engine


def tier_lease(source, salt: str = "", num_blocks: int = 4, min_blocks: int = 3):
    return KvLeaseServicer(source).LeasePrefix(pb.LeasePrefixRequest(
        request_id="r.prefix", block_hashes=HASHES[:num_blocks],
        token_ids=PROMPT[:num_blocks * BS], min_blocks=min_blocks, from_tier=True,
        cache_salt=salt), Context())


def tier_count(result: str) -> float:
    from pagoda.services.common.kv_transfer_metrics import kv_transfer_metrics

    return kv_transfer_metrics().tier_leases.labels(result)._value.get()


def test_a_tier_lease_onloads_the_run_through_a_one_token_request_then_leases_it():
    source, engine = tier_source(2, range(2, 4))  # blocks 0-1 on the device, 2-3 in the tier
    before = tier_count("leased")
    params = kv_params_from_proto(asyncio.run(tier_lease(source)).kv_transfer_params)
    [onload] = engine.submitted
    # The run's tokens and one more; one output token.
    assert onload.prompt_token_ids == PROMPT[:4 * BS] + PROMPT[4 * BS - 1:4 * BS]
    assert onload.sampling_params.max_tokens == 1
    assert params.block_hashes == HASHES[:4] and params.num_cached_tokens == 4 * BS
    assert source.table.num_leased_blocks == 4 and tier_count("leased") == before + 1
    assert source._waiters == {}


def test_a_tier_lease_without_tier_blocks_is_the_device_lease():
    source, engine = tier_source(4, range(0))
    params = kv_params_from_proto(asyncio.run(tier_lease(source)).kv_transfer_params)
    assert engine.submitted == [] and params.block_hashes == HASHES[:4]


def test_a_tier_lease_below_min_blocks_or_under_another_salt_onloads_nothing():
    source, engine = tier_source(1, range(1, 2))
    too_few, failed = tier_count("too_few_blocks"), tier_count("failed")
    assert not asyncio.run(tier_lease(source)).HasField("kv_transfer_params")
    assert tier_count("too_few_blocks") == too_few + 1
    # S holds the run (device + tier) under the unsalted hashes the caller names, but
    # the caller says its tenant's salt is another: those blocks are not its blocks.
    source, engine = tier_source(2, range(2, 4))
    assert not asyncio.run(tier_lease(source, salt="tenant-b")).HasField("kv_transfer_params")
    assert engine.submitted == [] and source.table.num_leased_blocks == 0
    assert tier_count("failed") == failed + 1


def test_a_caller_that_gives_up_aborts_the_onload_and_strands_no_lease():
    source, engine = tier_source(2, range(2, 4), finish=False)

    async def give_up():
        task = asyncio.ensure_future(tier_lease(source))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(give_up())
    [onload] = engine.submitted
    assert engine.aborted == [onload.request_id] and source._waiters == {}
    engine.run(onload)  # it finishes anyway (the abort raced its last step): no lease
    assert source.table.num_leased_blocks == 0

"""The prefill side after its worker's KV cache was set up again (a failed step): every
lease taken before answers not valid and new leases name the worker's new epoch; the
decode side releases a lease at once when its request ends mid-pull (client gone)."""

from __future__ import annotations

import asyncio

from test_kv_prefix_pull import (BS, HASHES, PROMPT, Context, InlineEngine, LeaseService,
                                 info, pool_holding, producer)

from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagoda.sampling_params import SamplingParams
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as pb
from pagoda.services.common.protocol.kv_transfer import kv_params_from_proto
from pagoda.services.scheduler.kv_consumer import KvConsumer
from pagoda.services.scheduler.kv_producer import KvLeaseServicer


def finished_prefill(source, request_id: str):
    """A remote-decode request that just finished on `source`: its lease's params."""
    request = EngineCoreRequest(request_id, list(PROMPT), SamplingParams(max_tokens=1))
    source.expect(request)
    out = EngineCoreOutput(request_id, [5], finish_reason=FinishReason.LENGTH)
    source.on_outputs([out])
    return out.kv_transfer_params


def test_a_kv_reset_ends_every_lease_and_renews_the_worker_epoch():
    source = producer(pool_holding(4))
    journal = []
    source.lease_journal = lambda pinned, released: journal.append(list(released))
    params = finished_prefill(source, "r1")
    assert params.remote_worker_epoch == "s-worker-epoch"
    # The worker's KV was re-allocated as zeros; its cached hashes are gone as well.
    source.table.pool.forget_contents()
    source.on_kv_reset("s-worker-epoch-2")
    assert journal[-1] == [params.lease_id]  # ended in Redis too
    servicer = KvLeaseServicer(source)
    reply = asyncio.run(servicer.ReleaseLease(pb.ReleaseLeaseRequest(
        lease_id=params.lease_id, epoch=params.remote_epoch), Context()))
    assert not reply.valid  # the decode side discards what it pulled and recomputes
    assert source.table.num_leased_blocks == 0
    assert source.table.pool.num_free_blocks == source.table.pool.num_blocks
    # Nothing zeroed is cached under the prompt's hashes: no lease, no local hit.
    assert finished_prefill(source, "r2") is None
    assert all(source.table.pool.get_cached_block(h, PROMPT[i * BS:(i + 1) * BS]) is None
               for i, h in enumerate(HASHES))


def test_an_unknown_worker_epoch_keeps_the_old_one_which_the_worker_refuses():
    source = producer(pool_holding(4))
    source.on_kv_reset(None)
    assert source.worker_epoch == "s-worker-epoch"


class StalledWorker:
    """A FetchBlocks that never ends (the pull is under way when the client leaves)."""

    async def FetchBlocks(self, request, timeout):
        await asyncio.sleep(3600)


def test_a_request_cancelled_mid_pull_releases_its_lease_at_once():
    source = producer(pool_holding(4))
    servicer = KvLeaseServicer(source)
    reply = asyncio.run(servicer.LeasePrefix(pb.LeasePrefixRequest(
        request_id="r.prefix", block_hashes=HASHES[:4], token_ids=PROMPT[:4 * BS],
        min_blocks=1), Context()))
    params = kv_params_from_proto(reply.kv_transfer_params)
    params.do_remote_prefill = True
    assert source.table.num_leased_blocks == 4
    request = EngineCoreRequest("r", list(PROMPT), SamplingParams(max_tokens=4),
                                kv_transfer_params=params)

    async def leave_mid_pull() -> None:
        consumer = KvConsumer(InlineEngine(), pool_holding(0), info("r"), "127.0.0.1:1", 5.0)
        consumer.worker = StalledWorker()
        consumer._lease_stubs["s-scheduler:1"] = LeaseService(source)
        handler = asyncio.ensure_future(consumer.prepare(request))
        await asyncio.sleep(0.05)
        handler.cancel()  # the client left; its pull is still under way
        for _ in range(100):
            if not source.table.leases:
                break
            await asyncio.sleep(0.01)
        released = not source.table.leases
        assert not handler.done()  # still waiting for the worker to stop writing
        handler.cancel()
        await asyncio.wait([handler])
        assert released

    asyncio.run(leave_mid_pull())
    assert source.table.num_leased_blocks == 0


def test_a_lease_whose_stream_ended_before_it_was_sent_is_released():
    """The caller (the gateway) left before the prefill's last output, the one naming
    the lease, went out: nobody will release it, so the stream's end does."""
    source = producer(pool_holding(4))
    sent = finished_prefill(source, "sent")
    source.forget("sent", delivered=True)
    assert list(source.table.leases) == [sent.lease_id]  # the caller releases it
    unsent = finished_prefill(source, "unsent")
    source.forget("unsent", delivered=False)
    assert list(source.table.leases) == [sent.lease_id]
    assert unsent.lease_id != sent.lease_id

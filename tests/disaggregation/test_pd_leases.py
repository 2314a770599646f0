"""Leases with real processes: a lease nobody claims is freed at --kv-lease-timeout (and
leaves Redis), a lease is in Redis while it lives, a stale epoch is refused, a client
that leaves mid-stream frees both sides at once, and 200 mixed requests with aborts
leave every pool empty and Redis without a lease."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import httpx
import openai
import pytest
import redis
from pd_cluster import role_address, start_pd, usage
from serve_cluster import wait_until

from pagoda.kv_transfer.params import KVTransferParams
from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services.common.protocol.scheduler import request_to_proto, response_to_output

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
LEASE_TIMEOUT_S = 4.0
PROMPT = " ".join(f"token{i}" for i in range(60))


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, redis_server):
    serve = start_pd(tiny_llama_dir, redis_server.url, "--kv-lease-timeout",
                     str(LEASE_TIMEOUT_S))
    yield serve
    assert serve.stop() == 0, serve.stderr_text()[-3000:]


@pytest.fixture(scope="module")
def store(redis_server):
    return redis.Redis.from_url(redis_server.url)


def lease_records(store) -> dict[str, dict]:
    """Every lease record in Redis: lease id -> its fields."""
    return {key.decode().rsplit(":", 1)[1]: {k.decode(): v.decode()
                                             for k, v in store.hgetall(key).items()}
            for key in store.keys("pagoda:kv:*:lease:*")}


def live_leases(pd) -> list[str]:
    with grpc.insecure_channel(role_address(pd, "scheduler", "kv_producer")) as channel:
        return list(kpb_grpc.KvLeaseServiceStub(channel).ListLeases(
            kpb.ListLeasesRequest(), timeout=10).lease_ids)


def all_free(pd, store) -> bool:
    return (usage(role_address(pd, "scheduler", "kv_producer")) == 0
            and usage(role_address(pd, "scheduler", "kv_consumer")) == 0
            and not live_leases(pd) and not lease_records(store))


def prefill_only(pd, request_id: str) -> KVTransferParams:
    """What the gateway asks of a prefill replica, sent straight to it; then nobody
    claims the lease (as if the decode replica died before it pulled)."""
    request = EngineCoreRequest(request_id, list(range(5, 70)),
                                SamplingParams(max_tokens=1, temperature=0.0),
                                eos_token_ids=[0],
                                kv_transfer_params=KVTransferParams(do_remote_decode=True))
    with grpc.insecure_channel(role_address(pd, "scheduler", "kv_producer")) as channel:
        stream = spb_grpc.SchedulerServiceStub(channel).Generate(request_to_proto(request),
                                                                 timeout=60)
        outputs = [response_to_output(request_id, message) for message in stream]
    params = outputs[-1].kv_transfer_params
    assert params is not None and params.lease_id and len(params.remote_block_ids) == 4
    return params


def test_an_unclaimed_lease_is_in_redis_then_freed_at_its_timeout(pd, store):
    params = prefill_only(pd, "unclaimed-1")
    records = lease_records(store)
    assert wait_until(lambda: params.lease_id in lease_records(store), 10), records
    record = lease_records(store)[params.lease_id]
    assert record["request_id"] == "unclaimed-1"
    assert record["block_ids"] == ",".join(map(str, params.remote_block_ids))
    assert live_leases(pd) == [params.lease_id]
    assert usage(role_address(pd, "scheduler", "kv_producer")) > 0  # pinned
    started = time.monotonic()
    assert wait_until(lambda: all_free(pd, store), LEASE_TIMEOUT_S + 10)
    assert time.monotonic() - started <= LEASE_TIMEOUT_S + 10


def test_a_stale_epoch_is_refused_by_both_prefill_services(pd, store):
    params = prefill_only(pd, "stale-1")
    with grpc.insecure_channel(params.remote_scheduler_address) as channel:
        reply = kpb_grpc.KvLeaseServiceStub(channel).ReleaseLease(
            kpb.ReleaseLeaseRequest(lease_id=params.lease_id, epoch="an-older-incarnation"),
            timeout=10)
    assert not reply.valid
    assert live_leases(pd) == [params.lease_id]  # a stale release frees nothing
    with grpc.insecure_channel(params.remote_worker_address) as channel:
        pull = kpb_grpc.KvTransferServiceStub(channel).PullBlocks(
            kpb.PullBlocksRequest(block_ids=params.remote_block_ids,
                                  epoch="an-older-incarnation", lease_id=params.lease_id),
            timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            list(pull)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with grpc.insecure_channel(params.remote_scheduler_address) as channel:
        assert kpb_grpc.KvLeaseServiceStub(channel).ReleaseLease(
            kpb.ReleaseLeaseRequest(lease_id=params.lease_id, epoch=params.remote_epoch),
            timeout=10).valid
    assert wait_until(lambda: all_free(pd, store), 10)


def test_a_client_leaving_mid_decode_frees_both_sides(pd, store):
    client = openai.OpenAI(base_url=pd.url, api_key="x", max_retries=0, timeout=120)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=400,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    assert wait_until(lambda: all_free(pd, store), 15)


def test_mixed_requests_with_aborts_leave_no_block_and_no_lease(pd, store):
    rng = random.Random(0)
    prefixes = [" ".join(f"p{k}w{i}" for i in range(20 + 10 * k)) for k in range(8)]

    async def one(client, i: int) -> str:
        prompt = f"{rng.choice(prefixes)} request {i}"
        max_tokens = rng.randint(1, 24)
        abort = rng.random() < 0.1
        if abort and i % 2:  # a streamed client that leaves after its first token
            stream = await client.completions.create(model="tiny", prompt=prompt,
                                                     max_tokens=64, stream=True,
                                                     extra_body={"ignore_eos": True})
            async for _ in stream:
                break
            await stream.close()
            return "aborted"
        if abort:  # a client that gives up before anything arrives
            try:
                await client.with_options(timeout=0.05).completions.create(
                    model="tiny", prompt=prompt, max_tokens=64)
            except (openai.APITimeoutError, httpx.TimeoutException):
                return "aborted"
            return "finished early"
        out = await client.completions.create(model="tiny", prompt=prompt,
                                              max_tokens=max_tokens, temperature=0.0)
        return out.choices[0].finish_reason

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=pd.url, api_key="x", max_retries=0, timeout=120)
        gate = asyncio.Semaphore(16)

        async def gated(i: int) -> str:
            async with gate:
                return await one(client, i)

        try:
            return await asyncio.gather(*(gated(i) for i in range(200)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert 5 <= results.count("aborted") <= 40, results
    assert set(results) <= {"aborted", "finished early", "stop", "length"}
    assert wait_until(lambda: all_free(pd, store), LEASE_TIMEOUT_S + 15), (
        usage(role_address(pd, "scheduler", "kv_producer")),
        usage(role_address(pd, "scheduler", "kv_consumer")), live_leases(pd),
        lease_records(store))

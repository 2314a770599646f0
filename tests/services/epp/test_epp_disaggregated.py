"""`pagoda epp` over a P/D pool (`pagoda serve --prefill-replicas 1 --decode-replicas 2`):
the picker chooses among the decode replicas only (a prefill replica is never a pool
member, not even when the subset hint names its address), and the member it names runs
the prompt on the prefill replica first, chosen by the same router as Pagoda's gateway
(the answer says which: X-Pagoda-Prefill-Instance), then decodes on its own replica."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy_client import ask, served
from epp_cluster import EppCluster

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # a cluster: make test-extended


@pytest.fixture(scope="module")
def pd_pool(tiny_llama_dir, redis_server):
    cluster = EppCluster(tiny_llama_dir, redis_server.url,
                         ("--prefill-replicas", "1", "--decode-replicas", "2")).start()
    yield cluster
    cluster.stop()


async def _pick(target: str, body, **kwargs):
    async with grpc.aio.insecure_channel(target) as channel:
        answer = await ask(channel, body, **kwargs)
        if answer.status == 0:
            await served(answer, answer.endpoints[0])
        return answer


def test_decode_member_chosen_and_prefill_done_on_the_prefill_replica(pd_pool):
    assert len(pd_pool.prefill) == 1 and len(pd_pool.schedulers) == 2
    for i in range(4):
        prompt = [1000 + i] * 40 + list(range(50, 90))
        answer = asyncio.run(_pick(pd_pool.epp, {"model": "tiny", "prompt": prompt}))
        assert answer.status == 0 and sorted(answer.endpoints) == sorted(pd_pool.members)
        reply = pd_pool.complete(answer.endpoints[0], prompt)
        assert reply.status_code == 200, reply.text
        decode = pd_pool.schedulers[pd_pool.members.index(answer.endpoints[0])]
        assert reply.headers["x-pagoda-instance"] == decode
        assert reply.headers["x-pagoda-prefill-instance"] == pd_pool.prefill[0]


def test_a_prefill_replica_is_never_a_member(pd_pool):
    prefill_host, _ = pd_pool.prefill[0].rsplit(":", 1)
    hint = [pd_pool.prefill[0], f"{prefill_host}:8000"]  # its gRPC and its would-be HTTP
    answer = asyncio.run(_pick(pd_pool.epp, {"model": "tiny", "prompt": "p"}, subset=hint))
    assert answer.status == 503

"""`pagoda epp` driven by an Envoy-side ext_proc client over real gRPC, in front of a
real two-replica cluster on loopback (epp_cluster.py): whole exchanges (headers, a
body in several chunks, the response headers), then the request sent where the picker
said, as the proxy would.

Shows: the endpoint goes out in the header and the `envoy.lb` metadata alike, with
the other member as fallback, and the body comes back unchanged; a long prompt cached
on one replica is sent to that replica's member (for each replica); the subset hint is
obeyed, and a subset with no pool member is a 503; a sheddable request with every
replica saturated is a 429 while a critical one is still routed; a body that is not an
OpenAI request is a 400 with OpenAI's error JSON; GIE's EPP metrics count it all. And
the picker's decisions against the cluster's own gateway's on the same workload: the
prefix cache hit rates within 5 points.
"""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import httpx
import pytest
from envoy_client import ask, served
from grpc_health.v1 import health_pb2, health_pb2_grpc
from epp_cluster import EppCluster
from prometheus_client.parser import text_string_to_metric_families
from serve_cluster import wait_until

from pagoda.services.bench.routing import (VOCAB, one_request, run_workload,
                                           shared_prefix_workload, summarize)

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # a cluster: make test-extended
PREFIX_LEN = 160  # 10 blocks


@pytest.fixture(scope="module")
def pool(tiny_llama_dir, redis_server):
    cluster = EppCluster(tiny_llama_dir, redis_server.url).start()
    yield cluster
    cluster.stop()


def run(coroutine):
    return asyncio.run(coroutine)


async def _exchange(target: str, body, **kwargs):
    async with grpc.aio.insecure_channel(target) as channel:
        answer = await ask(channel, body, **kwargs)
        if answer.status == 0:
            await served(answer, answer.endpoints[0])
        return answer


def test_whole_exchange_names_a_member_twice_and_returns_the_body(pool):
    body = {"model": "tiny", "prompt": "Hello there, endpoint picker", "max_tokens": 2}
    answer = run(_exchange(pool.epp, body, chunks=3))
    assert answer.status == 0
    assert answer.header == answer.metadata  # the protocol: the same value both ways
    assert answer.endpoints[0] in pool.members
    assert sorted(answer.endpoints) == sorted(pool.members)  # the other one as fallback
    assert json.loads(answer.body) == body  # sent back whole, after three chunks
    reply = pool.complete(answer.endpoints[0], body["prompt"])
    assert reply.status_code == 200, reply.text
    # The member that answered served it on its own replica.
    replica = pool.schedulers[pool.members.index(answer.endpoints[0])]
    assert reply.headers["x-pagoda-instance"] == replica


def test_a_cached_long_prompt_goes_to_the_replica_that_holds_it(pool):
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(PREFIX_LEN)] for _ in range(2)]
    for replica, prompt in enumerate(prompts):  # prompt i cached on replica i, directly
        assert pool.complete(pool.members[replica], prompt + [5, 6]).status_code == 200
        assert wait_until(lambda: pool.indexed_blocks(prompt).get(pool.schedulers[replica], 0)
                          >= PREFIX_LEN // 16, 30), pool.indexed_blocks(prompt)
    for _ in range(3):
        for replica, prompt in enumerate(prompts):
            suffix = [rng.randrange(100, 40000) for _ in range(8)]
            answer = run(_exchange(pool.epp, {"model": "tiny", "prompt": prompt + suffix,
                                              "max_tokens": 1}))
            assert answer.endpoints[0] == pool.members[replica]
            reply = pool.complete(answer.endpoints[0], prompt + suffix, max_tokens=1)
            details = reply.json()["usage"]["prompt_tokens_details"]
            assert details["cached_tokens"] >= PREFIX_LEN - 16, reply.json()["usage"]


def test_the_subset_hint_is_obeyed_and_an_empty_choice_is_503(pool):
    body = {"model": "tiny", "prompt": "subset", "max_tokens": 1}
    for member in pool.members:
        answer = run(_exchange(pool.epp, body, subset=[member, "10.9.9.9:8000"]))
        assert answer.endpoints == [member]
    answer = run(_exchange(pool.epp, body, subset=["10.9.9.9:8000"]))
    assert answer.status == 503
    assert answer.error["error"]["code"] == 503
    assert run(_exchange(pool.epp, body, subset=[])).status == 503


def test_sheddable_requests_are_shed_when_every_replica_is_saturated(pool):
    body = {"model": "tiny", "prompt": "shed me", "max_tokens": 1}
    shed = run(_exchange(pool.saturated, body,
                         headers={"x-gateway-inference-objective": "batch"}))
    assert shed.status == 429
    assert shed.error["error"]["code"] == 429
    for objective in ("chat", None):  # priority >= 0: never shed
        headers = {"x-gateway-inference-objective": objective} if objective else {}
        kept = run(_exchange(pool.saturated, body, headers=headers))
        assert kept.status == 0 and kept.endpoints[0] in pool.members


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "tiny", "prompt": ', None),           # cut short: not JSON
    (b'{"model": "tiny"}', "prompt"),                    # neither prompt nor messages
    (b'{"model": "tiny", "prompt": [1, "x"]}', "prompt"),
    (b'{"model": "tiny", "messages": "hi"}', "messages"),
    (b'{"model": 5, "prompt": "x"}', "model"),
])
def test_a_bad_body_is_a_400_in_openai_error_json(pool, raw, param):
    answer = run(_exchange(pool.epp, raw))
    assert answer.status == 400
    error = answer.error["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    assert error["param"] == param
    # The picker is still up and routing.
    ok = run(_exchange(pool.epp, {"model": "tiny", "prompt": "still here"}))
    assert ok.endpoints[0] in pool.members


def test_chat_bodies_are_routed(pool):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    answer = run(_exchange(pool.epp, body, path="/v1/chat/completions"))
    assert answer.status == 0 and answer.endpoints[0] in pool.members


def test_health_as_gie_probes_it(pool):
    """GIE's EPP health services: liveness, readiness and the ext_proc service name."""
    with grpc.insecure_channel(pool.epp) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


def test_gie_epp_metrics(pool):
    run(_exchange(pool.epp, {"model": "tiny", "prompt": "count me"}))
    run(_exchange(pool.epp, b"not json"))
    text = pool.metrics_text()
    assert 'inference_pool_ready_pods{name="tiny-pool"} 2.0' in text
    assert "inference_pool_average_kv_cache_utilization{" in text
    assert "inference_pool_average_queue_size{" in text
    assert 'inference_objective_request_total{model_name="tiny",target_model_name="tiny"}' in text
    assert 'error_code="BadRequest"' in text


async def _through_epp(pool: EppCluster, prompts: list[list[int]], concurrency: int,
                       output_len: int) -> list:
    """Each prompt picked by the EPP, then sent to the member it named (bench's request)."""
    semaphore = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(pool.epp) as channel:
        clients = {m: httpx.AsyncClient(base_url=f"http://{m}", timeout=None)
                   for m in pool.members}

        async def one(prompt):
            async with semaphore:
                answer = await ask(channel, {"model": "tiny", "prompt": prompt,
                                             "max_tokens": output_len})
                endpoint = answer.endpoints[0]
                result = await one_request(clients[endpoint], "tiny", prompt, output_len)
                await served(answer, endpoint)
                return result

        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            for client in clients.values():
                await client.aclose()


def affinity(prompts: list[list[int]], results: list) -> float:
    """Of the requests after the first of their prefix, the share sent to the replica
    that served the first one (where the prefix is cached)."""
    first: dict[tuple, str] = {}
    followed = later = 0
    for prompt, result in zip(prompts, results):
        key = tuple(prompt[:PREFIX_LEN])
        if key in first:
            later += 1
            followed += result.instance == first[key]
        else:
            first[key] = result.instance
    return followed / later


def test_the_picker_decides_as_the_gateway_does(pool):
    """One workload (16 shared prefixes x 4 users, shuffled, 2 at a time) through the
    cluster's own gateway, and the same workload with every token id shifted (the same
    prefixes in the same order, none cached yet) through the picker: their prefix cache
    hit rates within 5 points, and as many requests follow their prefix's replica."""
    prompts = shared_prefix_workload(16, 4, PREFIX_LEN, 16, seed=101)
    shifted = [[(t + 7919) % VOCAB for t in p] for p in prompts]
    gateway_results, _ = run(run_workload(pool.gateway_url, prompts, 2, 2, model="tiny"))
    epp_results = run(_through_epp(pool, shifted, 2, 2))
    gateway = summarize("gateway", gateway_results, 1.0)
    epp = summarize("epp", epp_results, 1.0)
    gateway_affinity = affinity(prompts, gateway_results)
    epp_affinity = affinity(shifted, epp_results)
    same = sum((g.cached_tokens > 0) == (e.cached_tokens > 0)
               for g, e in zip(gateway_results, epp_results)) / len(prompts)
    print(f"hit rate: gateway {gateway['cache_hit_rate']} epp {epp['cache_hit_rate']}; "
          f"prefix affinity: gateway {gateway_affinity:.3f} epp {epp_affinity:.3f}; "
          f"per replica: gateway {gateway['requests_per_replica']} "
          f"epp {epp['requests_per_replica']}; same hit/miss {same:.3f}")
    assert gateway["errors"] == 0 and epp["errors"] == 0, (gateway, epp)
    assert abs(gateway["cache_hit_rate"] - epp["cache_hit_rate"]) <= 0.05, (gateway, epp)
    assert epp["cache_hit_rate"] > 0.5  # most of the 3 in 4 repeat prefixes hit
    assert epp_affinity >= gateway_affinity - 0.05 and epp_affinity >= 0.8


def test_members_speak_gie_model_server_protocol(pool):
    """What GIE's vLLM engine type reads at a member's /metrics: queue, running, KV use
    and the cache config (block size, blocks); readiness at /health."""
    for member in pool.members:
        assert httpx.get(f"http://{member}/health", timeout=10).status_code == 200
        text = httpx.get(f"http://{member}/metrics", timeout=10).text
        samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                     "vllm:kv_cache_usage_perc"):
            assert name in samples, name
        info = samples["vllm:cache_config_info"].labels
        assert info["block_size"] == "16" and int(info["num_gpu_blocks"]) > 0
        # Only the member's own replica: one series per name.
        assert text.count("\nvllm:num_requests_waiting{") == 1

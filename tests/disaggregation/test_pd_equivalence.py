"""Greedy outputs through 1 prefill + 1 decode replica equal a colocated `pagoda serve`,
token for token; the decode replica pulls exactly the blocks it did not hold."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from pd_cluster import role_address, role_process
from serve_cluster import wait_until

from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc

pytestmark = pytest.mark.slow
LONG = " ".join(f"word{i}" for i in range(150))  # ~ 300+ tokens: many 16-token blocks


@pytest.fixture(scope="module")
def colocated(plain_tiny_cluster):
    """The session's plain tiny cluster: pd_cluster.BASE's flags, one replica."""
    return plain_tiny_cluster


@pytest.fixture(scope="module")
def pd(traced_pd_cluster):
    """The session's plain P/D cluster (conftest.py; tracing on, which changes no output)."""
    return traced_pd_cluster


def client(serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=120)


def leases(serve) -> kpb.ListLeasesResponse:
    address = role_address(serve, "scheduler", "kv_producer")
    with grpc.insecure_channel(address) as channel:
        return kpb_grpc.KvLeaseServiceStub(channel).ListLeases(kpb.ListLeasesRequest(),
                                                               timeout=10)


def metric(serve, name: str, **labels) -> float:
    return sum(v for (n, ls), v in serve.scrape().items()
               if n == name and all((k, val) in ls for k, val in labels.items()))


def test_roles_on_command_lines(pd):
    for kind in ("scheduler", "gpu-worker"):
        for role in ("kv_producer", "kv_consumer"):
            assert role_process(pd, kind, role).is_running()


@pytest.mark.parametrize("prompt,max_tokens", [("Hello there", 12), (LONG, 8)])
def test_completions_equal_colocated(pd, colocated, prompt, max_tokens):
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                  logprobs=2)
    want = client(colocated).completions.create(**kwargs)
    got = client(pd).completions.create(**kwargs)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(
        want.choices[0].logprobs.token_logprobs, abs=1e-3)
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens


def test_chat_streamed_n2_equal_colocated(pd, colocated):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": LONG[:400]}],
                  max_tokens=10, temperature=0.0, n=2, stream=True)

    def texts(serve):
        out = {}
        for chunk in client(serve).chat.completions.create(**kwargs):
            for choice in chunk.choices:
                out[choice.index] = out.get(choice.index, "") + (choice.delta.content or "")
        return out

    want = texts(colocated)
    assert texts(pd) == want and want[0] == want[1]


def test_headers_name_both_instances(pd):
    response = httpx.post(f"{pd.url}/completions", json={
        "model": "tiny", "prompt": "headers please", "max_tokens": 3, "temperature": 0},
        timeout=60)
    assert response.status_code == 200
    assert response.headers["x-pagoda-prefill-instance"] == role_address(
        pd, "scheduler", "kv_producer")
    assert response.headers["x-pagoda-instance"] == role_address(pd, "scheduler", "kv_consumer")


def test_blocks_pulled_are_prefilled_minus_held(pd):
    prompt_ids = list(range(1000, 1000 + 16 * 10 + 5))  # 10 full blocks
    before = metric(pd, "pagoda_kv_transfer_blocks_total")
    body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{pd.url}/completions", json=body, timeout=60).status_code == 200
    first = wait_until(lambda: metric(pd, "pagoda_kv_transfer_blocks_total") - before, 10)
    assert first == 10
    # The same prefix + 3 more blocks: the decode replica holds the first 10 already.
    body["prompt"] = prompt_ids[:160] + list(range(5000, 5000 + 16 * 3 + 2))
    assert httpx.post(f"{pd.url}/completions", json=body, timeout=60).status_code == 200
    second = wait_until(lambda: metric(pd, "pagoda_kv_transfer_blocks_total") - before - 10, 10)
    assert second == 3
    assert wait_until(lambda: leases(pd).num_leased_blocks == 0, 10)

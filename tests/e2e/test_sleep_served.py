"""Served sleep mode: `pagoda serve --enable-sleep-mode` on two replicas, driven through
vLLM's endpoints (POST /sleep, POST /wake_up, GET /is_sleeping) and the official client.
(Without the flag the endpoints are 404: test_cluster_tiny.py, on the shared cluster.)"""

from __future__ import annotations

import grpc
import httpx
import openai
import psutil
import pytest
from serve_cluster import CLI_MODULE, ServeProcess, flag_value, scheduler_load, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
PROMPT_IDS = [1, 504, 3458, 282, 4649, 314]  # token ids: no tokenizer in the way


@pytest.fixture(scope="module")
def served(tiny_llama_dir, redis_server):
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                          "--max-model-len", "256", "--block-size", "16",
                          "--data-parallel-size", "2", "--redis-url", redis_server.url,
                          "--enable-sleep-mode"])
    addresses = _scheduler_addresses(serve)
    assert len(addresses) == 2, addresses
    for address in addresses:  # /sleep must reach both: both serve first
        assert wait_until(lambda: _serving(address), 120), address
    yield serve
    assert serve.stop() == 0, serve.stderr_text()[-3000:]


def _scheduler_addresses(serve: ServeProcess) -> list[str]:
    addresses = []
    for child in psutil.Process(serve.process.pid).children(recursive=True):
        argv = child.cmdline()
        if CLI_MODULE in argv and argv[argv.index(CLI_MODULE) + 1] == "scheduler":
            addresses.append(f"127.0.0.1:{flag_value(argv, '--port')}")
    return addresses


def _serving(address: str) -> bool:
    try:
        return scheduler_load(address).serving
    except grpc.RpcError:
        return False


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.base, timeout=120) as c:
        yield c


def greedy_ids(client, max_tokens: int = 12) -> list[int]:
    out = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=max_tokens,
                                    temperature=0.0, logprobs=0,
                                    extra_body={"ignore_eos": True,
                                                "return_tokens_as_token_ids": True})
    return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


def is_sleeping(http) -> bool:
    response = http.get("/is_sleeping")
    assert response.status_code == 200, response.text
    return response.json()["is_sleeping"]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_refuses_requests_and_wake_up_serves_the_same_model(client, http, level):
    before = greedy_ids(client)
    assert not is_sleeping(http)
    response = http.post("/sleep", params={"level": level})
    assert response.status_code == 200, response.text
    assert is_sleeping(http)

    with pytest.raises(openai.APIStatusError) as refused:  # both replicas sleep: no hang
        greedy_ids(client)
    assert refused.value.status_code == 503
    assert "sleeping" in refused.value.response.json()["error"]["message"]

    response = http.post("/wake_up")
    assert response.status_code == 200, response.text
    assert not is_sleeping(http)
    # Level 1 brought the host copy back; level 2 reloaded the checkpoint.
    assert greedy_ids(client) == before


def test_wake_up_by_tags(client, http):
    before = greedy_ids(client)
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert is_sleeping(http)  # the KV cache still sleeps: still refused
    with pytest.raises(openai.APIStatusError) as refused:
        greedy_ids(client)
    assert refused.value.status_code == 503
    assert http.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert not is_sleeping(http)
    assert greedy_ids(client) == before


def test_bad_level_or_tag_is_a_400_naming_it(http):
    response = http.post("/sleep", params={"level": 3})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "level"
    response = http.post("/wake_up", params={"tags": "everything"})
    assert response.status_code == 400
    assert "everything" in response.json()["error"]["message"]
    assert not is_sleeping(http)


def test_sleep_with_a_request_in_flight_is_refused_and_no_replica_sleeps(client, http):
    stream = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=200,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # the request runs on one replica now
        response = http.post("/sleep")
        assert response.status_code == 409, response.text
        assert "1 request(s) are in flight" in response.json()["error"]["message"]
    finally:
        stream.close()
    # The idle replica had gone to sleep for this call: it was woken again.
    assert not is_sleeping(http)
    assert greedy_ids(client, max_tokens=4)

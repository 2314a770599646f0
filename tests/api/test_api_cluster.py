"""The API against the real services (tiny random Llama): logprobs, aborts, back-pressure.

One cluster for the module, with a small batch (8 sequences) and a small waiting
queue (8), so back-pressure is reachable with one request of n = 32.
"""

from __future__ import annotations

import json
import math
import time
import uuid

import grpc
import httpx
import openai
import pytest
from api_strategies import REQUESTS
from serve_cluster import ServeProcess, flag_value, wait_until
from hypothesis import HealthCheck, event, given, settings

from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as wpb
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as wpb_grpc
from pagoda.services.common.redis_server import PrivateRedis

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 512
BLOCK_SIZE = 16  # the engine's default --block-size
LONG = {"max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    with PrivateRedis() as redis:
        serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "tiny-alias",
                              "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                              "--max-num-seqs", "8", "--max-waiting-requests", "8",
                              "--redis-url", redis.url])
        yield serve
        assert serve.stop() == 0, serve.stderr_text()[-3000:]


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster.url, api_key="unused", max_retries=0, timeout=120)


def assert_pool_returns_to_full(load, timeout: float = 10.0) -> None:
    """No request left and every KV block free (usage counts cached free blocks as free)."""
    def idle() -> bool:
        s = load()
        return s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0
    assert wait_until(idle, timeout), load()


def test_aliases_are_listed_with_the_context_length(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert {m.model_extra["max_model_len"] for m in models} == {MAX_MODEL_LEN}
    assert client.completions.create(model="tiny-alias", prompt="Hi", max_tokens=2).choices


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_chat_logprobs_pick_the_top_token(client, stream):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Count to five."}],
                  max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=3,
                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        content = [e for c in chunks if c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True)


def test_echo_logprobs_equal_prompt_logprobs(client):
    prompt = "The quick brown fox jumps over the lazy dog"
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                       logprobs=2)
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                       extra_body={"prompt_logprobs": 2})
    rows = scored.choices[0].model_extra["prompt_logprobs"]
    logprobs = echoed.choices[0].logprobs
    assert echoed.choices[0].text == prompt and "".join(logprobs.tokens) == prompt
    assert logprobs.token_logprobs[0] is None and rows[0] is None
    assert len(rows) == len(logprobs.tokens) == echoed.usage.prompt_tokens
    for lp, top, row in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], rows[1:]):
        chosen = next(v for v in row.values() if v["rank"] is not None and
                      math.isclose(v["logprob"], lp, abs_tol=1e-5))
        assert chosen["decoded_token"] in top and len(row) <= 3 and lp <= 0


def test_streamed_logprobs_equal_non_streamed(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0.0,
                  logprobs=1, echo=True, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    lps = [t for c in chunks if c.choices[0].logprobs
           for t in c.choices[0].logprobs.token_logprobs]
    assert tokens == whole.logprobs.tokens
    assert lps == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)


def test_cache_salt_shares_cached_prefixes_only_within_one_salt(cluster, client, load):
    """vLLM's cache_salt: the same prompt hits the prefix cache only under the salt it
    was cached with (the scheduler's prefix-cache hit counter tells each request's)."""
    prompt = f"{uuid.uuid4().hex} " + "a salted prefix that fills blocks " * 12
    count = httpx.post(f"{cluster.url[:-3]}/tokenize", json={"prompt": prompt}).json()["count"]

    def cached_tokens(**extra) -> int:
        before = load().prefix_cache_hits
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra)
        return load().prefix_cache_hits - before

    hit = (count - 1) // BLOCK_SIZE * BLOCK_SIZE  # whole blocks, never the last token
    assert hit > 0
    assert cached_tokens(cache_salt="tenant-a") == 0
    assert cached_tokens(cache_salt="tenant-a") == hit
    assert cached_tokens(cache_salt="tenant-b") == 0
    assert cached_tokens() == 0
    assert cached_tokens() == hit


def test_priority_needs_the_priority_policy(client):
    """This cluster schedules fcfs: a non-zero priority gets vLLM's 400."""
    with pytest.raises(openai.BadRequestError,
                       match="Got priority 5 but Priority scheduling is not enabled."):
        client.completions.create(model="tiny", prompt="x", max_tokens=1,
                                  extra_body={"priority": 5})
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1,
                                     extra_body={"priority": 0}).choices


def test_stream_disconnect_frees_every_kv_block(cluster, load):
    body = {"model": "tiny", "prompt": "Keep talking " * 20, "stream": True, **LONG}
    with httpx.stream("POST", f"{cluster.url}/completions", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(5):
            next(lines)
        busy = load()
        assert busy.num_running == 1 and busy.kv_cache_usage > 0
    assert_pool_returns_to_full(load)


def test_client_timeout_frees_every_kv_block(cluster, load):
    body = {"model": "tiny", "prompt": "Keep talking", **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.url}/completions", json=body,
                   timeout=httpx.Timeout(60, read=0.5))
    assert_pool_returns_to_full(load)


def test_stop_string_abort_frees_every_kv_block(client, load):
    out = client.completions.create(model="tiny", prompt="a b c", temperature=0.0, max_tokens=400,
                                    extra_body={"ignore_eos": True, "stop": [" ", "e", "a"]})
    assert out.choices[0].finish_reason == "stop"
    assert_pool_returns_to_full(load)


def test_full_queue_is_503_with_retry_after_then_recovers(cluster, client, load):
    body = {"model": "tiny", "prompt": "Hello", "n": 32, **LONG}
    r = httpx.post(f"{cluster.url}/completions", json=body, timeout=60)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == 503
    assert_pool_returns_to_full(load)  # the choices that were accepted are aborted
    assert client.completions.create(model="tiny", prompt="Hello", max_tokens=2, n=8).choices


@settings(max_examples=90, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(request=REQUESTS)
def test_any_body_gets_2xx_or_a_4xx_envelope_and_the_service_stays_up(cluster, request):
    path, body = request
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{cluster.url}{path}", content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many got through
    if 400 <= r.status_code < 500:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == r.status_code
    else:
        assert r.status_code == 200, (r.status_code, r.text)
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [line[len("data: "):] for line in r.text.splitlines() if line]
            assert events[-1] == "[DONE]"
            assert all("error" not in json.loads(e) for e in events[:-1]), r.text
        else:
            assert r.json()["choices"]
            assert_usage(path, json.loads(raw), r.json())
    assert httpx.get(f"{cluster.url[:-3]}/health", timeout=10).status_code == 200


def assert_usage(path: str, body: dict, reply: dict) -> None:
    """completion_tokens against what each choice shows: its logprob rows when it has
    them (one per token: exact); else a choice that stopped for length made exactly
    its limit, one that stopped early (EOS, a stop token id or string) between one
    token and its limit. A scored-only echo (max_tokens 0) makes none."""
    usage, choices = reply["usage"], reply["choices"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    chat = path == "/chat/completions"
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    requested = body.get(name, None if chat else 16)
    if not chat and body.get("echo") is True and requested == 0:
        assert usage["completion_tokens"] == 0
        return
    single_prompt = chat or isinstance(body["prompt"], str) or len(body["prompt"]) == 1 or \
        all(isinstance(t, int) for t in body["prompt"])
    # prompt_tokens counts the one prompt, so its room in the context is known.
    room = MAX_MODEL_LEN - usage["prompt_tokens"] if single_prompt else MAX_MODEL_LEN
    if type(requested) is int:  # noqa: E721 (not True, not 3.0, not "3": coerced junk)
        limit = min(requested, room)
    elif requested is None and single_prompt:
        limit = room  # no max_tokens: up to the end of the context
    else:
        limit = None  # a value the gateway coerced: only its bounds are known
    low = high = 0
    for choice in choices:
        rows = (choice.get("logprobs") or {}).get("content" if chat else "tokens")
        if rows is not None and not body.get("echo"):
            count = (len(rows),) * 2
        elif limit is not None and choice["finish_reason"] == "length":
            count = (limit, limit)
        else:
            count = (1, room if limit is None else limit)
        low, high = low + count[0], high + count[1]
    assert low <= usage["completion_tokens"] <= high, (usage, choices)


def test_many_bad_requests_then_good_ones(cluster, client, load):
    started = time.monotonic()
    for body in ({"prompt": [10**6]}, {"prompt": "x", "max_tokens": MAX_MODEL_LEN},
                 {"prompt": "x", "temperature": -3}, {"messages": []}):
        path = "/chat/completions" if "messages" in body else "/completions"
        r = httpx.post(f"{cluster.url}{path}", json={"model": "tiny", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "user", "content": "Hi"}]).choices[0].message.content is not None
    assert time.monotonic() - started < 30
    assert_pool_returns_to_full(load)  # nothing the random bodies started is left holding KV


def test_typed_but_wrong_grpc_messages_straight_to_the_services(cluster, client, load):
    """A caller inside the network (or a bug) sends well-typed nonsense straight to the
    scheduler and the gpu-worker: each message gets its error, the cluster serves on."""
    scheduler_args = cluster.service_args("scheduler")
    scheduler = cluster.scheduler_address()
    worker = flag_value(scheduler_args, "--worker-addr")
    params = cpb.SamplingParams(temperature=0.0, top_p=1.0, max_tokens=4,
                                repetition_penalty=1.0)
    bad_requests = [
        spb.GenerateRequest(request_id="x", prompt_token_ids=[5], sampling_params=params,
                            output_token_ids=[10**9]),
        spb.GenerateRequest(request_id="y", prompt_token_ids=[5], sampling_params=cpb.SamplingParams(
            temperature=0.0, top_p=1.0, max_tokens=4, repetition_penalty=1.0, logprobs=10**6)),
        spb.GenerateRequest(request_id="z", prompt_token_ids=[5] * 600, sampling_params=params),
    ]
    with grpc.insecure_channel(scheduler) as channel:
        stub = spb_grpc.SchedulerServiceStub(channel)
        for message in bad_requests:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(message, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(worker) as channel:
        stub = wpb_grpc.WorkerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.InitializeKvCache(wpb.InitializeKvCacheRequest(num_blocks=0), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:  # not the scheduler's step
            stub.ExecuteModel(wpb.ExecuteModelRequest(step_id=10**9), timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert httpx.get(f"{cluster.url[:-3]}/health", timeout=10).status_code == 200
    assert load().serving
    assert client.completions.create(model="tiny", prompt="Hello", max_tokens=3).choices

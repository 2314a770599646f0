"""The gateway's OpenAI API over a real tokenizer servicer and a scripted scheduler."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from serve_cluster import wait_until
from gateway_harness import BAD_TOKEN, MAX_MODEL_LEN, SCRIPT, run_gateway


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def script_text(tokenizer, n):
    return tokenizer.decode(tokenizer.encode(SCRIPT, add_special_tokens=False)[:n])


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion_text_and_usage(client, smollm2_tokenizer, gateway):
    out = client.completions.create(model="fake-model", prompt="Hi there", max_tokens=6)
    assert out.choices[0].text == script_text(smollm2_tokenizer, 6)
    assert out.choices[0].finish_reason == "length"
    prompt_len = len(smollm2_tokenizer.encode("Hi there"))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_len, 6)
    assert list(gateway.scheduler.requests[-1].prompt_token_ids) == \
        smollm2_tokenizer.encode("Hi there")


def test_streamed_completion_equals_non_streamed(client):
    whole = client.completions.create(model="fake-model", prompt="Hi", max_tokens=12)
    chunks = list(client.completions.create(model="fake-model", prompt="Hi", max_tokens=12,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streamed_and_not(client, smollm2_tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    whole = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=8)
    assert whole.choices[0].message.content == script_text(smollm2_tokenizer, 8)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="fake-model", messages=messages,
                                                 max_tokens=8, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_default_max_tokens_is_the_remaining_context(client, gateway):
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}])
    req = gateway.scheduler.requests[-1]
    assert req.sampling_params.max_tokens == MAX_MODEL_LEN - len(req.prompt_token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_text_aborts_request_and_counts_tokens(client, gateway, stream,
                                                                smollm2_tokenizer):
    kwargs = dict(model="fake-model", prompt="Hi", max_tokens=40, stop=["END"])
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0] for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        out = client.completions.create(**kwargs)
        text, finish, usage = out.choices[0].text, out.choices[0], out.usage
    assert text == SCRIPT[:SCRIPT.index("END")]
    assert finish.finish_reason == "stop" and finish.model_extra["stop_reason"] == "END"
    ids = smollm2_tokenizer.encode(SCRIPT, add_special_tokens=False)
    used = next(i for i in range(1, len(ids) + 1) if "END" in smollm2_tokenizer.decode(ids[:i]))
    assert usage.completion_tokens == used
    rid = gateway.scheduler.requests[-1].request_id
    deadline = time.monotonic() + 5
    while rid not in gateway.scheduler.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rid in gateway.scheduler.cancelled  # the scheduler stopped generating


def test_n_fans_out_into_n_scheduler_requests(client, gateway):
    before = len(gateway.scheduler.requests)
    out = client.completions.create(model="fake-model", prompt="Hi", max_tokens=3, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) == 1 and out.usage.completion_tokens == 9
    sent = gateway.scheduler.requests[before:]
    assert len(sent) == 3 and len({r.request_id for r in sent}) == 3
    chunks = list(client.completions.create(model="fake-model", prompt="Hi", max_tokens=3, n=2,
                                            stream=True))
    assert {c.choices[0].index for c in chunks} == {0, 1}


def test_errors_use_the_openai_envelope(gateway, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="Hi")
    assert "nope" in info.value.body["message"] and info.value.body["code"] == 404
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake-model", prompt="Hi", max_tokens=MAX_MODEL_LEN)
    assert str(MAX_MODEL_LEN) in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake-model", prompt="Hi", temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:  # the scheduler's rejection
        client.completions.create(model="fake-model", prompt=[BAD_TOKEN, 5], max_tokens=2)
    assert "not allowed" in info.value.body["message"]
    raw = httpx.post(f"{gateway.url}/v1/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param",
                                                                   "code"}
    missing = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "fake-model"})
    assert missing.status_code == 400
    # ...and good requests still work.
    assert client.completions.create(model="fake-model", prompt="Hi", max_tokens=2).choices


def test_scheduler_failure_mid_stream_is_an_error_event(gateway, client):
    gateway.scheduler.fail_after = 3
    try:
        with pytest.raises(openai.APIError) as info:
            for _ in client.completions.create(model="fake-model", prompt="Hi", max_tokens=20,
                                               stream=True):
                pass
        # No other replica to move to: the error event says what happened in words,
        # without the scheduler's own text (it stays in the gateway's log).
        assert "stopped answering" in str(info.value) and "worker gone" not in str(info.value)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="fake-model", prompt="Hi", max_tokens=20)
        assert info.value.status_code == 503
    finally:
        gateway.scheduler.fail_after = None


def test_tokenize_and_detokenize_shapes(gateway, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hello world")
    r = httpx.post(f"{gateway.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    r = httpx.post(f"{gateway.url}/tokenize", json={
        "messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"])
    r = httpx.post(f"{gateway.url}/detokenize", json={"tokens": ids}).json()
    assert r == {"prompt": "Hello world"}
    assert httpx.get(f"{gateway.url}/version").json()["version"]
    # A replica marked down by an earlier test's failure is probed back within seconds.
    assert wait_until(lambda: httpx.get(f"{gateway.url}/health").status_code == 200, 30)
    assert "python_info" in httpx.get(f"{gateway.url}/metrics").text


def test_api_key_guards_v1_routes_only(peers):
    server = run_gateway(peers[0], peers[1], api_key="sekret")
    url = server.url
    try:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models",
                         headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{url}/v1/models",
                         headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
    finally:
        server.stop()

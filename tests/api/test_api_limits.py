"""Requests from outside: every limit is a flag with a 400 (413 for the body) naming it, a
request-supplied chat template needs --trust-request-chat-template, the API key guards
/tokenize and /detokenize (and /metrics on request), a message too large for gRPC is a
413, and no error carries a peer's address or its own words."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from api_fakes import ENGINE_ERROR_TOKEN, QUEUE_FULL_TOKEN, Gateway

from pagoda.services.gateway.errors import from_grpc_error
from pagoda.services.gateway.limits.request_limits import RequestLimits, json_depth
from pagoda.services.gateway.serving_options import ServingOptions

KEY = "k-limits"
LIMITS = RequestLimits(max_request_body_bytes=200_000, max_prompts_per_request=4,
                       max_choices_per_request=6, max_stop_strings=3, max_stop_string_length=10,
                       max_stop_token_ids=3, max_logit_bias_entries=3, max_messages=5,
                       max_bad_words=3)


@pytest.fixture(scope="module")
def limited(fake_peers):
    gw = Gateway(fake_peers, options=ServingOptions(limits=LIMITS))
    yield gw
    gw.stop()


def post(gw, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1{path}", json=body, timeout=30, **kwargs)


@pytest.mark.parametrize(("path", "body", "flag"), [
    ("/completions", {"prompt": ["a"] * 5}, "max-prompts-per-request"),
    ("/completions", {"prompt": ["a", "b"], "n": 4}, "max-choices-per-request"),
    ("/completions", {"prompt": "a", "stop": ["x", "y", "z", "w"]}, "max-stop-strings"),
    ("/completions", {"prompt": "a", "stop": "s" * 11}, "max-stop-string-length"),
    ("/completions", {"prompt": "a", "stop_token_ids": [1, 2, 3, 4]}, "max-stop-token-ids"),
    ("/completions", {"prompt": "a", "logit_bias": {str(i): 1 for i in range(4)}},
     "max-logit-bias-entries"),
    ("/completions", {"prompt": "a", "logprobs": 21}, "20"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 6}, "max-messages"),
    ("/completions", {"prompt": "a", "bad_words": ["w"] * 4}, "max-bad-words"),
    ("/responses", {"input": [{"role": "user", "content": "x"}] * 6}, "max-messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                           "top_logprobs": 21}, "20"),
])
def test_each_limit_is_a_400_naming_its_flag(limited, path, body, flag):
    r = post(limited, path, {"model": "fake-model", "max_tokens": 2, **body})
    assert r.status_code == 400 and flag in r.json()["error"]["message"], r.text


def test_a_body_over_the_limit_is_a_413_before_it_is_read(limited):
    big = {"model": "fake-model", "prompt": "x" * 300_000, "max_tokens": 2}
    r = post(limited, "/completions", big)
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "fake-model", "max_tokens": 2, "prompt": "'
        for _ in range(30):
            yield b"y" * 10_000
        yield b'"}'

    r = httpx.post(f"{limited.url}/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert post(limited, "/completions", {"model": "fake-model", "prompt": "ok",
                                          "max_tokens": 2}).status_code == 200


def test_deep_json_is_a_400(limited):
    nested = b'{"a":[' * 5000 + b"1" + b"]}" * 5000
    body = b'{"model":"fake-model","max_tokens":2,"messages":[{"role":"user","content":"x"}],' \
           b'"chat_template_kwargs":' + nested + b"}"
    r = httpx.post(f"{limited.url}/v1/chat/completions", content=body, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    shallow = {"x": json.loads(b'{"a":[' * 40 + b"1" + b"]}" * 40)}
    r = post(limited, "/chat/completions", {"model": "fake-model", "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "x"}],
                                            "chat_template_kwargs": shallow})
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    assert json_depth(shallow, 1000) == 81
    # The Responses API's input is held to the same nesting bound.
    r = post(limited, "/responses", {"model": "fake-model", "max_output_tokens": 2,
                                     "input": [{"role": "user", "content": "x",
                                                "deep": shallow}]})
    assert r.status_code == 400 and "input is nested" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body", [
    {"chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}},
    {"chat_template": "{{ 7*7 }}"},
])
def test_a_request_template_needs_the_operators_trust(fake_peers, limited, body):
    base = {"model": "fake-model", "max_tokens": 2,
            "messages": [{"role": "user", "content": "x"}]}
    r = post(limited, "/chat/completions", {**base, **body})
    assert r.status_code == 400 and "--trust-request-chat-template" in r.text
    r = httpx.post(f"{limited.url}/tokenize", json={**base, **body}, timeout=30)
    assert r.status_code == 400 and "--trust-request-chat-template" in r.text
    trusting = Gateway(fake_peers, options=ServingOptions(trust_request_chat_template=True))
    try:
        r = httpx.post(f"{trusting.url}/tokenize", json={**base, **body}, timeout=30)
        assert r.status_code == 200
        detok = httpx.post(f"{trusting.url}/detokenize", json={"tokens": r.json()["tokens"]})
        assert detok.json()["prompt"] == "49"  # the request's template, sandboxed
    finally:
        trusting.stop()


def test_the_api_key_guards_tokenize_detokenize_and_on_request_metrics(fake_peers):
    plain = Gateway(fake_peers, api_key=KEY)
    strict = Gateway(fake_peers, api_key=KEY, options=ServingOptions(metrics_require_key=True))
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        for gw in (plain, strict):
            for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
                assert httpx.post(f"{gw.url}{path}", json=body).status_code == 401
                assert httpx.post(f"{gw.url}{path}", json=body, headers=auth).status_code == 200
            assert httpx.get(f"{gw.url}/health").status_code == 200
        assert httpx.get(f"{plain.url}/metrics").status_code == 200
        assert httpx.get(f"{strict.url}/metrics").status_code == 401
        assert httpx.get(f"{strict.url}/metrics", headers=auth).status_code == 200
    finally:
        plain.stop()
        strict.stop()


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_grpc_errors_reach_clients_in_words():
    too_big = from_grpc_error(_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        "Received message larger than max (300 vs. 200)"),
                              "scheduler 10.0.0.7:50052")
    assert too_big.status == 413 and "Retry-After" not in (too_big.headers or {})
    full = from_grpc_error(_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full"),
                           "scheduler 10.0.0.7:50052")
    assert full.status == 503 and full.headers["Retry-After"]
    failed = from_grpc_error(_RpcError(grpc.StatusCode.UNKNOWN,
                                       "Exception calling application: Traceback ... x.py"),
                             "scheduler 10.0.0.7:50052")
    assert failed.status == 500 and "10.0.0.7" not in failed.message
    assert "Traceback" not in failed.message and "scheduler" in failed.message


def test_peer_failures_carry_no_peer_words(gateway):
    r = post(gateway, "/completions", {"model": "fake-model", "prompt": [ENGINE_ERROR_TOKEN, 5],
                                       "max_tokens": 2})
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "exploded" not in message and "127.0.0.1" not in message
    r = post(gateway, "/completions", {"model": "fake-model", "prompt": [QUEUE_FULL_TOKEN, 5],
                                       "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"]

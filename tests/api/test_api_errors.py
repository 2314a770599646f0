"""vLLM's error contract: the envelope, the status, the numbers (gateway + fakes)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from api_fakes import ENGINE_ERROR_TOKEN, MAX_MODEL_LEN, MODEL, QUEUE_FULL_TOKEN

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hi"}]


def assert_envelope(response: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


def post(gateway, path: str, body=None, content: bytes | None = None) -> httpx.Response:
    if content is None:  # json.dumps escapes lone surrogates ("\\ud800"), as a client may
        content = json.dumps(body).encode()
    return httpx.post(f"{gateway.url}{path}", content=content,
                      headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("path, body", [(COMPLETIONS, {"prompt": "Hi"}),
                                        (CHAT, {"messages": HELLO})])
def test_unknown_model_is_404_naming_it(gateway, path, body):
    error = assert_envelope(post(gateway, path, {"model": "gpt-17", **body}), 404, "model")
    assert "gpt-17" in error["message"] and error["type"] == "NotFoundError"


def test_context_overflow_is_400_with_the_numbers(gateway, smollm2_tokenizer):
    long_prompt = [5] * (MAX_MODEL_LEN + 4)
    error = assert_envelope(post(gateway, COMPLETIONS, {"model": MODEL, "prompt": long_prompt}),
                            400, "prompt")
    assert str(MAX_MODEL_LEN) in error["message"] and str(MAX_MODEL_LEN + 4) in error["message"]
    num_prompt = len(smollm2_tokenizer.encode("Hi there"))
    error = assert_envelope(post(gateway, COMPLETIONS, {"model": MODEL, "prompt": "Hi there",
                                                        "max_tokens": MAX_MODEL_LEN}),
                            400, "max_tokens")
    for number in (MAX_MODEL_LEN, num_prompt, MAX_MODEL_LEN + num_prompt):
        assert str(number) in error["message"]
    assert_envelope(post(gateway, CHAT, {"model": MODEL, "messages": [
        {"role": "user", "content": "word " * MAX_MODEL_LEN}]}), 400, "messages")


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2),
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("repetition_penalty", 0),
    ("n", 0), ("n", 129), ("max_tokens", -5), ("max_tokens", 0), ("min_tokens", 99),
    ("seed", 2**64), ("top_k", 2**40), ("stop", [""]), ("stop_token_ids", [-1]),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"49152": 1}), ("stream_options",
                                                               {"include_usage": True}),
    ("suffix", "tail"), ("cache_salt", ""), ("cache_salt", "\udfff"),
])
def test_out_of_range_parameters_are_400_naming_the_field(gateway, field, value):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, field: value}
    assert_envelope(post(gateway, COMPLETIONS, body), 400, field)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": 5}, "prompt"),
    ({"model": MODEL, "prompt": [1, "a"]}, "prompt"),
    ({"model": MODEL, "prompt": "Hi", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "Hi", "n": 1.5}, "n"),
    ({"model": MODEL, "prompt": "Hi", "stream": "maybe"}, "stream"),
    ({"model": MODEL, "prompt": "Hi", "stop": 7}, "stop"),
    ({"model": 3, "prompt": "Hi"}, "model"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": [[]]}, "prompt"),
    ({"model": MODEL, "prompt": [49152]}, "prompt"),
    ({"model": MODEL, "prompt": [[1, 2], [-1]]}, "prompt"),
    ({"model": MODEL, "prompt": "Hi\ud800"}, None),
    ({"model": MODEL, "prompt": "Hi", "stop": "\udfff"}, "stop"),
    # Not silently ignored: the answer without them would differ from what was asked.
    # Beam search (n is the beam width): what it cannot honour is named, never ignored.
    ({"model": MODEL, "prompt": "Hi", "use_beam_search": True, "n": 0}, "n"),
    ({"model": MODEL, "prompt": "Hi", "use_beam_search": True, "n": 11}, "n"),
    ({"model": MODEL, "prompt": "Hi", "use_beam_search": True, "n": 2, "best_of": 3}, "best_of"),
    ({"model": MODEL, "prompt": "Hi", "use_beam_search": True, "logprobs": 2}, "logprobs"),
    ({"model": MODEL, "prompt": "Hi", "use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"model": MODEL, "prompt": "Hi", "use_beam_search": True, "temperature": -1},
     "temperature"),
    ({"model": MODEL, "prompt": "Hi", "best_of": 3}, "best_of"),
    ({"model": MODEL, "prompt": "Hi", "n": 2, "best_of": 4}, "best_of"),
])
def test_bad_completion_bodies_are_400(gateway, body, param):
    assert_envelope(post(gateway, COMPLETIONS, body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": ["hello"]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages"),
    ({"model": MODEL, "messages": HELLO, "continue_final_message": True}, None),
    ({"model": MODEL, "messages": HELLO, "chat_template_kwargs": {"tools": 1}}, None),
    ({"model": MODEL, "messages": HELLO, "chat_template_kwargs": {"x": 10**400}},
     "chat_template_kwargs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x", "name": 5}]}, "messages"),
    ({"model": MODEL, "messages": HELLO, "tools": [{"type": "function", "function": {}}]},
     "tools"),
    ({"model": MODEL, "messages": HELLO, "response_format": {"type": "xml"}},
     "response_format"),
    ({"model": MODEL, "messages": HELLO, "response_format": {"type": "json_schema"}},
     "response_format"),
    ({"model": MODEL, "messages": HELLO, "tool_choice": "required"}, "tool_choice"),
    ({"model": MODEL, "messages": HELLO, "max_completion_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": HELLO, "use_beam_search": True, "stop": ["x"]}, "stop"),
    ({"model": MODEL, "messages": HELLO, "use_beam_search": True, "n": 11}, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
])
def test_bad_chat_bodies_are_400(gateway, body, param):
    assert_envelope(post(gateway, CHAT, body), 400, param)


@pytest.mark.parametrize("content", [b"{not json", b"", b"[]", b'"text"', b"null",
                                     b'{"model": "fake-model", "prompt": "Hi", '
                                     b'"temperature": NaN}'])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_malformed_bodies_are_400_never_422(gateway, path, content):
    assert_envelope(post(gateway, path, content=content), 400)


def test_unknown_route_and_method_use_the_envelope(gateway):
    assert_envelope(httpx.get(f"{gateway.url}/v1/nothing-here"), 404)
    assert_envelope(httpx.get(f"{gateway.url}{COMPLETIONS}"), 405)


@pytest.mark.parametrize("stream", [False, True])
def test_full_queue_is_503_with_retry_after(gateway, stream):
    r = post(gateway, COMPLETIONS, {"model": MODEL, "prompt": [QUEUE_FULL_TOKEN, 5],
                                    "max_tokens": 3, "stream": stream})
    assert_envelope(r, 503)
    assert int(r.headers["retry-after"]) >= 1 and "overloaded" in r.json()["error"]["message"]


def test_engine_failure_is_500_non_streamed(gateway):
    r = post(gateway, COMPLETIONS, {"model": MODEL, "prompt": [ENGINE_ERROR_TOKEN, 5],
                                    "max_tokens": 3})
    message = assert_envelope(r, 500)["message"]
    # What failed, in words; the engine's own text stays in the gateway's log.
    assert message == "The scheduler failed while handling the request (INTERNAL)."


def test_engine_failure_mid_stream_is_an_error_event_then_done(gateway, client):
    gateway.scheduler.fail_after = 3
    try:
        with httpx.stream("POST", f"{gateway.url}{COMPLETIONS}", timeout=30, json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 20, "stream": True}) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 500 and "scheduler failed" in error["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])
        with pytest.raises(openai.APIError, match="scheduler failed"):
            list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20,
                                                stream=True))
    finally:
        gateway.scheduler.fail_after = None


def test_the_server_still_answers_after_bad_requests(gateway, client):
    for content in (b"{", b"[]", b'{"prompt": [99999999999]}'):
        post(gateway, COMPLETIONS, content=content)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text
    assert httpx.get(f"{gateway.url}/health").status_code == 200

"""vLLM's extra request fields through the gateway (over fakes): what reaches the
scheduler, and vLLM's answers for what is wrong."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from api_fakes import MAX_MODEL_LEN, MODEL

CHAT = [{"role": "user", "content": "Hello there"}]


def test_priority_reaches_the_scheduler(client, last_request):
    client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert last_request().priority == 0
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                   extra_body={"priority": -7})
    assert last_request().priority == -7


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_truncate_prompt_tokens_keeps_the_last_tokens(client, last_request, smollm2_tokenizer,
                                                      api):
    if api == "chat":
        whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
        full_ids = list(last_request().prompt_token_ids)
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                             extra_body={"truncate_prompt_tokens": 4})
    else:
        text = "one two three four five six seven"
        whole = client.completions.create(model=MODEL, prompt=text, max_tokens=1)
        full_ids = list(last_request().prompt_token_ids)
        out = client.completions.create(model=MODEL, prompt=text, max_tokens=1,
                                        extra_body={"truncate_prompt_tokens": 4})
    assert list(last_request().prompt_token_ids) == full_ids[-4:]
    assert out.usage.prompt_tokens == 4 < whole.usage.prompt_tokens


def test_truncate_prompt_tokens_bounds(client, last_request):
    client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1,
                              extra_body={"truncate_prompt_tokens": -1})  # the context
    assert list(last_request().prompt_token_ids) == [5, 6, 7]
    with pytest.raises(openai.BadRequestError, match="greater than max_model_len"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN + 1})
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 0})


def test_bad_words_travel_as_both_spellings(client, last_request, smollm2_tokenizer):
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                   extra_body={"bad_words": ["forty", " answer"]})
    sent = [list(w.token_ids) for w in last_request().sampling_params.bad_words_token_ids]
    enc = lambda t: smollm2_tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    # vLLM's rule: a word as written, and after a space when that is another token of the
    # same length (" forty" is one token, "forty" two: only the written form counts).
    assert sent == [enc("forty"), enc("answer"), enc(" answer")]
    assert len(enc(" forty")) != len(enc("forty"))
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"bad_words": [""]})


def test_allowed_token_ids_travel_and_are_checked(client, last_request):
    client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                              extra_body={"allowed_token_ids": [3, 1, 2]})
    assert list(last_request().sampling_params.allowed_token_ids) == [3, 1, 2]
    for ids, message in (([10**7], "out-of-vocab"), ([], "is not None and empty")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                      extra_body={"allowed_token_ids": ids})


def test_unknown_fields_are_ignored_with_a_warning(gateway, client, caplog):
    with caplog.at_level(logging.WARNING, logger="pagoda.services.gateway.openai.request_models"):
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                             extra_body={"frobnicate": 3, "use_beam_search": 0})
    assert out.choices[0].message.content
    assert any("frobnicate" in r.getMessage() and "ignored" in r.getMessage()
               for r in caplog.records)
    reply = httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "x", "max_tokens": 1, "nonsense": [1]})
    assert reply.status_code == 200


def test_return_tokens_as_token_ids_in_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True,
                                         top_logprobs=2,
                                         extra_body={"return_tokens_as_token_ids": True})
    tokens = out.choices[0].logprobs.content
    assert len(tokens) == 3 and all(t.token.startswith("token_id:") for t in tokens)
    assert all(c.token.startswith("token_id:") for t in tokens for c in t.top_logprobs)


@pytest.mark.parametrize("field,value", [("logits_processors", ["my.Processor"]),
                                         ("kv_transfer_params", {"do_remote_decode": True}),
                                         ("ec_transfer_params", {"x": 1}),
                                         ("media_io_kwargs", {"video": {"fps": 1}}),
                                         ("request_id", "abc"), ("return_token_ids", True),
                                         ("return_prompt_text", True),
                                         ("logprob_token_ids", [1, 2]),
                                         ("truncation_side", "right"),
                                         ("watermarking", True)])
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_vllm_fields_not_served_are_a_400_naming_them(gateway, field, value, api):
    body = {"model": MODEL, "max_tokens": 1, field: value,
            **({"messages": CHAT} if api == "chat" else {"prompt": "x"})}
    path = "chat/completions" if api == "chat" else "completions"
    reply = httpx.post(f"{gateway.url}/v1/{path}", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field
    assert "does not support" in reply.json()["error"]["message"]
    # null is as good as absent, and the server still answers
    body[field] = None
    assert httpx.post(f"{gateway.url}/v1/{path}", json=body, timeout=30).status_code == 200


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_vllm_fields_at_the_value_pagoda_gives_pass(gateway, api):
    """Spelling out what Pagoda does anyway (vLLM's default) is not refused, and the
    OpenAI and vLLM fields Pagoda serves pass together."""
    body = {"model": MODEL, "max_tokens": 1, "return_token_ids": False, "watermarking": False,
            "return_prompt_text": False, "truncation_side": "left", "truncate_prompt_tokens": 4,
            "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "seed": 3, "priority": 0,
            "cache_salt": "s", "vllm_xargs": {"k": 1}, "bad_words": ["zz"],
            "thinking_token_budget": -1, "user": "u", "presence_penalty": 0.1,
            **({"messages": CHAT} if api == "chat" else {"prompt": "x"})}
    path = "chat/completions" if api == "chat" else "completions"
    reply = httpx.post(f"{gateway.url}/v1/{path}", json=body, timeout=30)
    assert reply.status_code == 200, reply.text


def test_vllm_flat_repetition_fields_become_repetition_detection(client, last_request, gateway):
    client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={
        "max_repetition_pattern_size": 6, "min_repetition_pattern_size": 2,
        "repetition_min_count": 3})
    detection = last_request().sampling_params.repetition_detection
    assert (detection.max_pattern_size, detection.min_pattern_size, detection.min_count) == \
        (6, 2, 3)
    both = {"model": MODEL, "prompt": "x", "max_tokens": 1, "max_repetition_pattern_size": 6,
            "repetition_detection": {"max_pattern_size": 6}}
    reply = httpx.post(f"{gateway.url}/v1/completions", json=both, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "repetition_detection"


def test_reasoning_effort_is_a_chat_template_variable():
    """As vLLM: the template sees `reasoning_effort` (gpt-oss style templates read it),
    over the same key in chat_template_kwargs; unset, the kwargs are as sent."""
    from pagoda.services.gateway.openai.request_models import ChatCompletionRequest

    body = ChatCompletionRequest(model=MODEL, messages=CHAT, reasoning_effort="high",
                                 chat_template_kwargs={"reasoning_effort": "low", "x": 1})
    assert body.template_kwargs() == {"reasoning_effort": "high", "x": 1}
    assert ChatCompletionRequest(model=MODEL, messages=CHAT,
                                 chat_template_kwargs={"x": 1}).template_kwargs() == {"x": 1}
    with pytest.raises(Exception):
        ChatCompletionRequest(model=MODEL, messages=CHAT, reasoning_effort="extreme")


def test_mm_processor_kwargs_are_served_by_chat_and_refused_by_completions(gateway):
    reply = httpx.post(f"{gateway.url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "max_tokens": 1, "mm_processor_kwargs": {"fps": 1}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "mm_processor_kwargs"
    assert "chat API only" in reply.json()["error"]["message"]
    reply = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": CHAT, "max_tokens": 1, "mm_processor_kwargs": {"fps": 1}})
    assert reply.status_code == 200, reply.text  # a text-only chat: nothing to process

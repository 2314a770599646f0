"""Every request field reaches the service that reads it; prompts, chat messages, n, usage
(gateway + fakes)."""

from __future__ import annotations

import httpx
import openai
import pytest
from api_fakes import MAX_MODEL_LEN, MODEL, SCRIPT

SAMPLING = dict(temperature=0.7, top_p=0.9, seed=1234, presence_penalty=0.5,
                frequency_penalty=-0.5, stop=["zzz", "qqq"])
EXTRA = dict(top_k=7, min_p=0.05, repetition_penalty=1.2, stop_token_ids=[42, 43],
             ignore_eos=True, min_tokens=2, include_stop_str_in_output=True,
             skip_special_tokens=False, spaces_between_special_tokens=False)


def script_text(tokenizer, n: int) -> str:
    return tokenizer.decode(tokenizer.encode(SCRIPT, add_special_tokens=False)[:n])


def assert_params(sp, options, max_tokens: int) -> None:
    """`sp`: what the scheduler got (the engine fields); `options`: what the tokenizer
    got (the text fields)."""
    assert sp.max_tokens == max_tokens
    assert (sp.temperature, sp.top_p, sp.seed) == (0.7, 0.9, 1234)
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.5, -0.5)
    assert (sp.top_k, sp.min_p, sp.repetition_penalty) == (7, 0.05, 1.2)
    assert list(sp.stop_token_ids) == [42, 43] and sp.ignore_eos and sp.min_tokens == 2
    assert dict(sp.logit_bias) == {11: 100.0, 12: -3.0}  # clamped to OpenAI's [-100, 100]
    assert list(options.stop) == ["zzz", "qqq"]
    assert options.include_stop_str_in_output and not options.skip_special_tokens
    assert not options.spaces_between_special_tokens


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_every_sampling_field_reaches_its_reader(client, gateway, last_request, api, stream):
    extra = dict(EXTRA, logit_bias={"11": 250, "12": -3}, cache_salt=f"tenant-{api}")
    if api == "chat":
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=5,
            max_tokens=99, user="u-1", stream=stream, extra_body=extra, **SAMPLING)
    else:
        out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, user="u-1",
                                        stream=stream, extra_body=extra, **SAMPLING)
    if stream:
        list(out)
    # max_completion_tokens wins over max_tokens
    assert_params(last_request().sampling_params, gateway.peers.tokenizer.decode_options[-1],
                  max_tokens=5)
    assert last_request().cache_salt == f"tenant-{api}"


@pytest.mark.parametrize("prompt, expected", [
    ("Hello there", [["Hello there"]]),
    (["Hello", "Bye now"], [["Hello"], ["Bye now"]]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6], [7, 8, 9]], [[5, 6], [7, 8, 9]]),
])
def test_completion_prompt_forms(client, gateway, smollm2_tokenizer, prompt, expected):
    before = len(gateway.scheduler.requests)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=2)
    sent = gateway.scheduler.requests[before:]
    want = [smollm2_tokenizer.encode(p[0]) if isinstance(p[0], str) else p for p in expected]
    assert sorted(list(r.prompt_token_ids) for r in sent) == sorted(w for w in want
                                                                     for _ in range(2))
    assert [c.index for c in out.choices] == list(range(2 * len(want)))
    assert out.usage.prompt_tokens == sum(len(w) for w in want)  # once per prompt, not per n
    assert out.usage.completion_tokens == 3 * 2 * len(want)
    assert all(c.text == script_text(smollm2_tokenizer, 3) for c in out.choices)


def chat_prompt_ids(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def test_chat_roles_and_content_parts_render_with_the_template(client, last_request,
                                                               smollm2_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is"},
                                     {"type": "text", "text": "the weather?"}]},
        {"role": "assistant", "content": "Let me check."},
        {"role": "tool", "content": "sunny", "tool_call_id": "call-1"},
        {"role": "user", "content": "And so?"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    flat = [dict(m) for m in messages]
    flat[1]["content"] = "What is\nthe weather?"
    assert list(last_request().prompt_token_ids) == chat_prompt_ids(
        smollm2_tokenizer, flat, add_generation_prompt=True)


def test_chat_template_switches(client, last_request, smollm2_tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=dict(
        add_generation_prompt=False, continue_final_message=True))
    continued = list(last_request().prompt_token_ids)
    assert continued == chat_prompt_ids(smollm2_tokenizer, messages, continue_final_message=True)
    assert smollm2_tokenizer.decode(continued).endswith("Hel")
    client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=2,
                                   extra_body=dict(add_generation_prompt=False))
    assert list(last_request().prompt_token_ids) == chat_prompt_ids(
        smollm2_tokenizer, messages[:1], add_generation_prompt=False)
    # A request-supplied template is refused unless the operator trusts them.
    with pytest.raises(openai.BadRequestError, match="--trust-request-chat-template"):
        client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {
                                           "chat_template": "{{ messages[0]['content'] }}"}})


def test_chat_default_max_tokens_is_the_remaining_context(client, last_request):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    req = last_request()
    assert req.sampling_params.max_tokens == MAX_MODEL_LEN - len(req.prompt_token_ids)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_n_streams_every_index_with_its_own_text(client, smollm2_tokenizer, api):
    if api == "chat":
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=3,
            stream=True))
        texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks
                            if c.choices[0].index == i) for i in range(3)}
        roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
        assert sorted(roles) == [0, 1, 2]
    else:
        chunks = list(client.completions.create(model=MODEL, prompt=["Hi", "Yo"], max_tokens=4,
                                                n=2, stream=True))
        texts = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
                 for i in range(4)}
    assert set(texts.values()) == {script_text(smollm2_tokenizer, 4)}
    finished = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finished) == sorted(texts)  # one finish per index


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_usage_is_exact_and_last_with_include_usage(client, api):
    kwargs = dict(model=MODEL, max_tokens=5, n=2)
    create = (lambda **kw: client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], **kw)) if api == "chat" else \
        (lambda **kw: client.completions.create(prompt="Hi there", **kw))
    whole = create(**kwargs)
    assert whole.usage.completion_tokens == 10
    chunks = list(create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(create(**kwargs, stream=True))
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)


def test_continuous_usage_stats_count_each_choice_as_it_goes(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt="Hi there", max_tokens=6, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_unknown_fields_are_ignored_like_vllm(gateway):
    r = httpx.post(f"{gateway.url}/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "some_future_field": {"x": 1}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_best_of_equal_to_n_and_beam_search_off_are_accepted(gateway):
    """vLLM clients send these defaults: they change nothing, so they are no error."""
    r = httpx.post(f"{gateway.url}/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 2, "best_of": 2,
        "use_beam_search": False})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2

"""logprobs, top_logprobs, prompt_logprobs and echo in OpenAI's shapes (gateway + fakes).

The fake scheduler's logprobs are a known function of the position (see api_fakes),
so every number the gateway renders can be checked exactly.
"""

from __future__ import annotations

import httpx
import pytest
from api_fakes import MODEL, SCRIPT, output_logprob, prompt_logprob

PROMPT = "Hi there friend"


@pytest.fixture
def script(smollm2_tokenizer):
    return smollm2_tokenizer.encode(SCRIPT, add_special_tokens=False)


def text_of(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def expected_legacy(tokenizer, token_ids, logprobs, k):
    """OpenAI's legacy completions logprobs for tokens with the fake's candidates."""
    tokens = [text_of(tokenizer, t) for t in token_ids]
    tops = []
    for t, lp in zip(token_ids, logprobs):
        if lp is None:
            tops.append(None)
            continue
        top = {text_of(tokenizer, t): lp}
        for j in range(k):
            top[text_of(tokenizer, t + j)] = lp - j
        tops.append(top)
    offsets = [sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def merge_legacy(chunks) -> dict:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key in merged:
                merged[key] += getattr(chunk.choices[0].logprobs, key)
    return merged


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_legacy_shape(client, smollm2_tokenizer, script, stream):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2)
    expected = expected_legacy(smollm2_tokenizer, script[:4],
                               [output_logprob(i) for i in range(4)], 2)
    if stream:
        got = merge_legacy(client.completions.create(**kwargs, stream=True))
    else:
        got = client.completions.create(**kwargs).choices[0].logprobs.model_dump()
    assert got == expected


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_leads_with_the_prompt_and_its_logprobs(client, smollm2_tokenizer,
                                                                script, stream):
    prompt_ids = smollm2_tokenizer.encode(PROMPT)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=1, echo=True)
    lps = [None, *(prompt_logprob(p) for p in range(1, len(prompt_ids))),
           *(output_logprob(i) for i in range(3))]
    expected = expected_legacy(smollm2_tokenizer, prompt_ids + script[:3], lps, 1)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        assert chunks[0].choices[0].text.startswith(PROMPT)
        got = merge_legacy(chunks)
    else:
        out = client.completions.create(**kwargs)
        text, got = out.choices[0].text, out.choices[0].logprobs.model_dump()
        assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 3
    assert text == PROMPT + smollm2_tokenizer.decode(script[:3])
    assert got == expected


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_scores_the_prompt_only(client, smollm2_tokenizer, stream):
    prompt_ids = smollm2_tokenizer.encode(PROMPT)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    expected = expected_legacy(smollm2_tokenizer, prompt_ids,
                               [None, *(prompt_logprob(p) for p in range(1, len(prompt_ids)))], 0)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        got, finish, usage = merge_legacy(chunks), chunks[-2].choices[0], chunks[-1].usage
    else:
        out = client.completions.create(**kwargs)
        text, got = out.choices[0].text, out.choices[0].logprobs.model_dump()
        finish, usage = out.choices[0], out.usage
    assert text == PROMPT and got == expected
    assert finish.finish_reason == "length" and usage.completion_tokens == 0


def test_echo_of_token_id_prompt_is_its_text(client, smollm2_tokenizer, script):
    ids = smollm2_tokenizer.encode("Good morning")
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True)
    assert out.choices[0].text == "Good morning" + smollm2_tokenizer.decode(script[:2])


def test_prompt_logprobs_vllm_shape(client, smollm2_tokenizer):
    prompt_ids = smollm2_tokenizer.encode(PROMPT)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                    extra_body={"prompt_logprobs": 1})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt_ids)
    for position, entry in enumerate(got[1:], start=1):
        token = prompt_ids[position]
        assert entry == {str(token): {"logprob": prompt_logprob(position), "rank": 1,
                                      "decoded_token": text_of(smollm2_tokenizer, token)}}
    assert out.choices[0].logprobs is None  # prompt logprobs alone do not add logprobs
    chat = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "Hi"}], extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def expected_chat(tokenizer, token_ids, k):
    content = []
    for i, t in enumerate(token_ids):
        text = text_of(tokenizer, t)
        top = [{"token": text_of(tokenizer, t + j), "logprob": output_logprob(i) - j,
                "bytes": list(text_of(tokenizer, t + j).encode())} for j in range(k)]
        content.append({"token": text, "logprob": output_logprob(i), "bytes": list(text.encode()),
                        "top_logprobs": top})
    return content


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_openai_shape(client, smollm2_tokenizer, script, stream):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                  logprobs=True, top_logprobs=2)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        got = [entry.model_dump() for c in chunks if c.choices[0].logprobs
               for entry in c.choices[0].logprobs.content]
    else:
        out = client.chat.completions.create(**kwargs)
        got = [entry.model_dump() for entry in out.choices[0].logprobs.content]
    assert got == expected_chat(smollm2_tokenizer, script[:4], 2)
    plain = client.chat.completions.create(model=MODEL, messages=kwargs["messages"], max_tokens=2,
                                           logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[], []]


def test_tokens_as_token_ids(client, script):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=1,
                                    extra_body={"return_tokens_as_token_ids": True})
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in script[:2]]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, logprobs=True,
        top_logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    assert chat.choices[0].logprobs.content[0].token == f"token_id:{script[0]}"


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_stop_where_a_stop_string_cut_the_text(client, stream):
    kwargs = dict(model=MODEL, prompt="Hi", max_tokens=40, stop=["END"], logprobs=0)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True}))
        got, usage = merge_legacy(chunks), chunks[-1].usage
    else:
        out = client.completions.create(**kwargs)
        got, usage = out.choices[0].logprobs.model_dump(), out.usage
    assert "".join(got["tokens"]).startswith(SCRIPT[:SCRIPT.index("END")])
    assert len(got["tokens"]) == usage.completion_tokens < 40


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_prepends_the_continued_message(client, stream):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure,"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=3, extra_body=dict(
        echo=True, add_generation_prompt=False, continue_final_message=True))
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        assert chunks[1].choices[0].delta.content == "Sure,"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert text.startswith("Sure,") and len(text) > len("Sure,")


def test_infinite_logprobs_are_clamped_in_json():
    from pagoda.services.gateway.openai.logprobs import (TokenLogprob, chat_logprobs,
                                                         completion_logprobs)

    tokens = [TokenLogprob(5, "a", float("-inf"), 9)]
    assert completion_logprobs(tokens, 0)["token_logprobs"] == [-9999.0]
    assert chat_logprobs(tokens, 0)["content"][0]["logprob"] == -9999.0


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ({"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": -1},
     "top_logprobs"),
])
def test_bad_logprobs_requests_are_400(gateway, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(f"{gateway.url}{path}", json={"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param

"""Served thinking_token_budget, --reasoning-config and repetition_detection, through
the official client: the reasoning is exactly the budget with and without speculative
decoding (a draft model equal to the target: every draft accepted), a looping answer
stops with finish_reason "repetition", and bad values are 400s naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from serve_cluster import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended

REASONING = json.dumps({"think_start_str": "<think>", "think_end_str": "</think>"})
BASE = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256",
        "--block-size", "16", "--num-gpu-blocks-override", "128", "--reasoning-config", REASONING]
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def markers(smollm2_tokenizer):
    ids = lambda s: smollm2_tokenizer.convert_tokens_to_ids(smollm2_tokenizer.tokenize(s))
    return ids("<think>"), ids("</think>")


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer, markers):
    return smollm2_tokenizer.encode("Monday, Tuesday, Wednesday, Monday,") + markers[0]


@pytest.fixture(scope="module")
def clusters(tiny_llama_dir):
    draft = json.dumps({"model": tiny_llama_dir, "num_speculative_tokens": 4})
    started = {}
    try:
        for name, extra in (("plain", []), ("draft", ["--speculative-config", draft])):
            started[name] = ServeProcess([tiny_llama_dir, *BASE, *extra])
        yield {name: openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=120)
               for name, s in started.items()}
    finally:
        for serve in started.values():
            serve.stop()


def _token_ids(client, prompt, **extra) -> tuple[list[int], object]:
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra})
    choice = out.choices[0]
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens], choice


def _find(tokens, marker) -> int:
    return next((i for i in range(len(tokens)) if tokens[i:i + len(marker)] == marker), -1)


def test_served_reasoning_is_exactly_the_budget_with_and_without_speculation(
        clusters, prompt, markers):
    free, _ = _token_ids(clusters["plain"], prompt)
    assert _find(free, markers[1]) == -1  # the model never closes its thinking by itself
    for budget in (0, 4, 11):
        plain, _ = _token_ids(clusters["plain"], prompt, thinking_token_budget=budget)
        draft, _ = _token_ids(clusters["draft"], prompt, thinking_token_budget=budget)
        assert _find(plain, markers[1]) == budget and plain[:budget] == free[:budget]
        assert draft == plain  # speculation changes no token, the budget holds exactly
    unlimited, _ = _token_ids(clusters["draft"], prompt, thinking_token_budget=-1)
    assert unlimited == free


def test_served_repetition_detection_stops_a_loop(clusters, prompt):
    # logit_bias makes the model repeat one token forever: a real loop.
    loop = {"logit_bias": {"1000": 100}}
    detection = {"max_pattern_size": 3, "min_count": 4}
    tokens, choice = _token_ids(clusters["plain"], prompt, repetition_detection=detection,
                                **loop)
    assert (choice.finish_reason, choice.model_extra.get("stop_reason")) == \
        ("repetition", "repetition_detected")
    assert tokens == [1000] * 4
    tokens, choice = _token_ids(clusters["plain"], prompt, **loop)  # without: max_tokens
    assert choice.finish_reason == "length" and len(tokens) == MAX_TOKENS
    stream = clusters["draft"].chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS,
        temperature=0, stream=True, extra_body={"repetition_detection": detection, **loop})
    reasons = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert reasons == ["repetition"]


@pytest.mark.parametrize("extra, param", [
    ({"thinking_token_budget": -2}, "thinking_token_budget"),
    ({"repetition_detection": {"max_pattern_size": 3, "min_count": 1}},
     "repetition_detection.min_count"),
    ({"repetition_detection": {"max_pattern_size": 3, "min_count": 2, "window": 5}},
     "repetition_detection.window"),
])
def test_bad_values_are_400s_naming_the_field(clusters, prompt, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        _token_ids(clusters["plain"], prompt, **extra)
    assert info.value.body["param"] == param

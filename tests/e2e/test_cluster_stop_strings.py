"""Served and offline requests share one decoder: with stop strings, min_tokens and stop
token ids, a greedy request through the cluster (official openai client) gives the text,
finish_reason, stop_reason and token count the offline `LLM` gives."""

from __future__ import annotations

import pytest
from completion_result import completion_result

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time"
MAX_TOKENS = 24
MIN_TOKENS = 6


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=1024)


@pytest.fixture(scope="module")
def unconstrained(llm):
    """The greedy output's token ids and each prefix's text."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.text


def offline(llm, **params):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                              ignore_eos=True, **params),
                       use_tqdm=False)[0].outputs[0]
    return out.text, out.finish_reason, out.stop_reason, len(out.token_ids)


def served(client, stream: bool, stop=None, **extra):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                  stop=stop, extra_body={"ignore_eos": True, **extra})
    return completion_result(client, stream, **kwargs)


def test_min_tokens_with_a_stop_string_served_as_offline(llm, unconstrained, tiny_client):
    ids, text = unconstrained
    first = llm.get_tokenizer().decode(ids[:MIN_TOKENS])
    assert text.startswith(first)
    # A stop string that the first MIN_TOKENS tokens contain and later text repeats.
    stop = next(c for c in first if not c.isspace() and c in text[len(first):])
    early = offline(llm, stop=[stop])
    assert early[:3] == (text[:text.index(stop)], "stop", stop)
    held = offline(llm, stop=[stop], min_tokens=MIN_TOKENS)
    assert held[1:3] == ("stop", stop) and len(held[0]) >= len(first) > len(early[0])
    for stream in (False, True):
        assert served(tiny_client, stream, stop=[stop]) == early
        assert served(tiny_client, stream, stop=[stop], min_tokens=MIN_TOKENS) == held


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_served_as_offline(llm, unconstrained, tiny_client, include):
    ids, _ = unconstrained
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    expected = offline(llm, stop_token_ids=[ids[k]], include_stop_str_in_output=include)
    tokenizer = llm.get_tokenizer()
    assert expected == (tokenizer.decode(ids[:k + include]), "stop", ids[k], k + 1)
    for stream in (False, True):
        assert served(tiny_client, stream, stop_token_ids=[ids[k]],
                      include_stop_str_in_output=include) == expected

"""`--stream-interval N`: a stream's deltas every N tokens, the same text (vLLM's flag).

The coalescer alone on scripted deltas, then the gateway (real tokenizer servicer,
scripted scheduler: one token per message) started with the flag, through the openai
client."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from app_server import AppServer
from gateway_harness import SCRIPT

from pagoda.services.gateway.app import create_app
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.generation.choices import ChoiceDelta
from pagoda.services.gateway.generation.stream_interval import coalesce_deltas
from pagoda.services.gateway.openai.logprobs import TokenLogprob
from pagoda.services.gateway.serving_options import ServingOptions, add_serving_args

INTERVAL = 4


def _deltas(count: int, fail_after: int | None = None, logprobs: bool = False):
    async def gen():
        for i in range(count):
            if fail_after is not None and i == fail_after:
                raise APIError("The tokenizer stopped decoding the answer; retry later.", 503)
            last = i == count - 1
            yield ChoiceDelta(0, f"<{i}>", [i], finish_reason="length" if last else None,
                              num_cached_tokens=i,
                              logprobs=[TokenLogprob(i, f"<{i}>")] if logprobs else None,
                              prompt_logprobs=[TokenLogprob(9, "p")] if logprobs and i == 0
                              else None)
    return gen()


def _collect(deltas) -> list[ChoiceDelta]:
    async def run():
        return [d async for d in deltas]
    return asyncio.run(run())


def test_first_delta_at_once_then_every_n_tokens_then_the_end():
    out = _collect(coalesce_deltas(_deltas(11, logprobs=True), INTERVAL))
    assert [d.token_ids for d in out] == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert "".join(d.text for d in out) == "".join(f"<{i}>" for i in range(11))
    assert [d.finish_reason for d in out] == [None, None, None, "length"]
    assert [lp.token_id for d in out for lp in d.logprobs] == list(range(11))
    assert [d.prompt_logprobs is not None for d in out] == [True, False, False, False]
    assert [d.num_cached_tokens for d in out] == [0, 4, 8, 10]  # each one's latest


def test_interval_one_changes_nothing():
    out = _collect(coalesce_deltas(_deltas(5), 1))
    assert [d.token_ids for d in out] == [[0], [1], [2], [3], [4]]


def test_held_tokens_go_out_before_the_error():
    seen: list[ChoiceDelta] = []

    async def run():
        async for delta in coalesce_deltas(_deltas(20, fail_after=7), INTERVAL):
            seen.append(delta)
    with pytest.raises(APIError):
        asyncio.run(run())
    assert [t for d in seen for t in d.token_ids] == list(range(7))  # none lost


def test_closing_early_closes_the_choice_stream():
    closed = []

    async def source():
        try:
            for i in range(100):
                yield ChoiceDelta(0, "x", [i])
        finally:
            closed.append(True)

    async def run():
        stream = coalesce_deltas(source(), INTERVAL)
        await stream.__anext__()
        await stream.__anext__()
        await stream.aclose()
    asyncio.run(run())
    assert closed == [True]  # and so the scheduler's request is aborted


def test_the_flag_is_vllms_and_refuses_zero():
    import argparse
    parser = argparse.ArgumentParser()
    add_serving_args(parser)
    assert parser.parse_args(["--stream-interval", "8"]).stream_interval == 8
    assert parser.parse_args([]).stream_interval == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--stream-interval", "0"])


@pytest.fixture(scope="module")
def coalescing_gateway(peers):
    server = AppServer(create_app(peers[0], [peers[1]], None, None,
                                  options=ServingOptions(stream_interval=INTERVAL)))
    yield server.url, peers[2]
    server.stop()


@pytest.fixture
def client(coalescing_gateway):
    return openai.OpenAI(base_url=f"{coalescing_gateway[0]}/v1", api_key="unused", max_retries=0)


def _token_counts(chunks) -> list[int]:
    """Tokens per content chunk, from vLLM's continuous usage stats (cumulative)."""
    counts, before = [], 0
    for chunk in chunks:
        if chunk.choices and chunk.usage is not None:
            counts.append(chunk.usage.completion_tokens - before)
            before = chunk.usage.completion_tokens
    return counts


def test_served_stream_sends_every_n_tokens_with_the_same_text(client):
    whole = client.completions.create(model="fake-model", prompt="Hi", max_tokens=14)
    chunks = list(client.completions.create(
        model="fake-model", prompt="Hi", max_tokens=14, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    counts = _token_counts(chunks)
    assert sum(counts) == 14 and counts[0] == 1  # the first token at once
    assert all(n >= INTERVAL for n in counts[1:-1])  # then at least N a delta
    assert len(counts) <= 1 + -(-13 // INTERVAL)
    assert chunks[-1].usage.completion_tokens == 14


def test_served_chat_stream_joins_to_the_same_message(client):
    messages = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="fake-model", messages=messages, max_tokens=9)
    chunks = list(client.chat.completions.create(model="fake-model", messages=messages,
                                                 max_tokens=9, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        whole.choices[0].message.content
    assert len([c for c in chunks if c.choices[0].delta.content]) <= 1 + -(-8 // INTERVAL)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_still_stops_at_its_token(client, coalescing_gateway):
    scheduler = coalescing_gateway[1]
    chunks = list(client.completions.create(model="fake-model", prompt="Hi", max_tokens=40,
                                            stop=["END"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == SCRIPT[:SCRIPT.index("END")]
    assert chunks[-1].choices[0].finish_reason == "stop"
    rid = scheduler.requests[-1].request_id
    deadline = time.monotonic() + 5
    while rid not in scheduler.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rid in scheduler.cancelled  # aborted, as at interval 1


def test_a_replica_failing_mid_stream_still_delivers_the_held_tokens(client, coalescing_gateway,
                                                                      smollm2_tokenizer):
    scheduler = coalescing_gateway[1]
    scheduler.fail_after = 6  # the scheduler's stream fails UNAVAILABLE after 6 tokens
    text = ""
    try:
        with pytest.raises(openai.APIError):
            for chunk in client.completions.create(model="fake-model", prompt="Hi",
                                                   max_tokens=20, stream=True):
                text += chunk.choices[0].text
    finally:
        scheduler.fail_after = None
    # Tokens 2-5 were held (N = 4 after the first); they reach the client before the error.
    ids = smollm2_tokenizer.encode(SCRIPT, add_special_tokens=False)
    assert text == smollm2_tokenizer.decode(ids[:6])

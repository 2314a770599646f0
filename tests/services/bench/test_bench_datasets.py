"""What `pagoda bench serve` sends: Poisson schedules, ShareGPT files, random text prompts.

The schedule is checked as generated numbers (seeded), not by timing a run.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest

from pagoda.services.bench.datasets import (arrival_times, load_sharegpt, random_requests,
                                            sharegpt_requests)


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_poisson_arrivals_have_exponential_gaps():
    rate, n = 4.0, 20_001
    times = arrival_times(n, rate, seed=11)
    assert times[0] == 0.0 and times == sorted(times)
    g = gaps(times)
    mean = statistics.fmean(g)
    assert mean == pytest.approx(1 / rate, rel=0.03)
    # An exponential's standard deviation equals its mean, and P(gap > mean) = 1/e.
    assert statistics.pstdev(g) / mean == pytest.approx(1.0, abs=0.04)
    assert sum(x > 1 / rate for x in g) / len(g) == pytest.approx(math.exp(-1), abs=0.015)
    # The whole run lasts about n / rate seconds.
    assert times[-1] == pytest.approx((n - 1) / rate, rel=0.03)


def test_burstiness_changes_the_spread_not_the_rate():
    steady = gaps(arrival_times(20_001, 2.0, burstiness=4.0, seed=1))
    bursty = gaps(arrival_times(20_001, 2.0, burstiness=0.25, seed=1))
    for g in (steady, bursty):
        assert statistics.fmean(g) == pytest.approx(0.5, rel=0.05)
    # A gamma gap's coefficient of variation is 1/sqrt(shape).
    assert statistics.pstdev(steady) / statistics.fmean(steady) == pytest.approx(0.5, abs=0.03)
    assert statistics.pstdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, abs=0.15)


def test_schedule_is_fixed_by_the_seed():
    assert arrival_times(50, 3.0, seed=5) == arrival_times(50, 3.0, seed=5)
    assert arrival_times(50, 3.0, seed=5) != arrival_times(50, 3.0, seed=6)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_times(5, 0.0)


def write_sharegpt(tmp_path, entries) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return str(path)


def conversation(prompt: str, reply: str, *more: str) -> dict:
    turns = [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]
    return {"id": prompt[:8], "conversations": turns + [{"from": "human", "value": m} for m in more]}


LONG = "word " * 1100  # over the 1,024-token prompt limit
VALID = [conversation("Tell me about the moon and its phases.", "The moon has eight phases, "
                      "from new moon to waning crescent.", "And the sun?"),
         conversation("Write a haiku about autumn leaves falling.", "Red leaves drift and fall, "
                      "quiet on the cold ground now."),
         conversation("Explain recursion to a child in simple words.", "Recursion is when a thing "
                      "is defined using a smaller copy of itself.")]


def test_sharegpt_file_keeps_first_two_turns(tmp_path):
    path = write_sharegpt(tmp_path, [*VALID, {"conversations": [{"from": "human", "value": "x"}]},
                                     "not a conversation", {"id": "no turns"}])
    assert load_sharegpt(path) == [(c["conversations"][0]["value"], c["conversations"][1]["value"])
                                   for c in VALID]


def test_sharegpt_requests_filter_and_measure(tmp_path, smollm2_tokenizer):
    too_short = conversation("Hi", "Hello there, how can I help you today?")
    too_long = conversation(LONG, "Yes, that is a long prompt indeed.")
    path = write_sharegpt(tmp_path, [*VALID, too_short, too_long])
    requests = sharegpt_requests(smollm2_tokenizer, path, 3, seed=0)
    assert sorted(r.prompt for r in requests) == sorted(c["conversations"][0]["value"] for c in VALID)
    replies = {c["conversations"][0]["value"]: c["conversations"][1]["value"] for c in VALID}
    for r in requests:
        assert r.prompt_token_ids == smollm2_tokenizer.encode(r.prompt, add_special_tokens=False)
        assert r.output_len == len(smollm2_tokenizer.encode(replies[r.prompt],
                                                            add_special_tokens=False))
    # The seed fixes the order; a fixed output length overrides the replies' lengths.
    assert [r.prompt for r in sharegpt_requests(smollm2_tokenizer, path, 3, seed=0)] == \
        [r.prompt for r in requests]
    assert {r.output_len for r in sharegpt_requests(smollm2_tokenizer, path, 3, 0, 2)} == {2}
    with pytest.raises(ValueError, match="only 3 usable"):
        sharegpt_requests(smollm2_tokenizer, path, 4, seed=0)


def test_random_prompts_are_text_of_the_asked_length(smollm2_tokenizer):
    requests = random_requests(smollm2_tokenizer, 8, 64, 10, seed=2)
    special = set(smollm2_tokenizer.all_special_ids)
    for r in requests:
        assert smollm2_tokenizer.encode(r.prompt, add_special_tokens=False) == r.prompt_token_ids
        assert r.prompt_len == 64 and r.output_len == 10
        assert not special & set(r.prompt_token_ids)
    assert len({r.prompt for r in requests}) == 8
    assert [r.prompt for r in random_requests(smollm2_tokenizer, 8, 64, 10, seed=2)] == \
        [r.prompt for r in requests]

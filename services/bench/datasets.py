"""What `pagoda bench serve` sends and when: prompts (random or ShareGPT) and arrival times.

Every function here is pure given its seed, so a run is reproducible with `--seed`
and the tests check the generated prompts and schedule, not the clock.

- `random_requests`: vLLM's random dataset. Random token ids (no special tokens)
  become text whose re-tokenization is exactly `input_len` tokens, because the
  text, not the ids, is what a served prompt normally is; `--prompt-format tokens`
  sends the ids themselves.
- `sharegpt_requests`: vLLM's ShareGPT dataset from a local JSON file: the first
  turn is the prompt, the second turn's token count the output length, with
  vLLM's filters (both at least 4 tokens, prompt at most 1,024, sum at most 2,048).
- `arrival_times`: vLLM's request-rate schedule: gaps drawn from a gamma
  distribution with shape `burstiness` and mean 1/rate (burstiness 1 is a
  Poisson process); an infinite rate sends everything at once.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

# vLLM's ShareGPT filters (benchmarks/datasets.py, is_valid_sequence).
MIN_SEQ_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


@dataclass
class BenchRequest:
    """One prompt: its text, its token ids (as this client's tokenizer sees the
    text; exactly what is sent with `--prompt-format tokens`) and the output length
    asked for with `max_tokens`."""

    prompt: str
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def sampleable_ids(tokenizer: Any) -> list[int]:
    """Token ids a random prompt may use: the whole vocabulary but the special tokens."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def text_of_length(tokenizer: Any, ids: list[int], target: int, rng: random.Random,
                   pool: list[int]) -> tuple[str, list[int]]:
    """(text, its token ids) with, where the tokenizer allows it, exactly `target` ids.

    Decoding random ids and encoding the text again merges or splits tokens, so
    the length drifts; trim what is too long, top up what is too short, and repeat
    (vLLM's `gen_prompt_decode_to_target_len`). A few rounds settle it; if they do
    not, the last text is used and its real length reported.
    """
    text, encoded = "", list(ids)
    for _ in range(10):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == target:
            break
        ids = (encoded[:target] if len(encoded) > target
               else encoded + [rng.choice(pool) for _ in range(target - len(encoded))])
    return text, encoded


def random_requests(tokenizer: Any, num: int, input_len: int, output_len: int,
                    seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    pool = sampleable_ids(tokenizer)
    requests = []
    for _ in range(num):
        ids = [rng.choice(pool) for _ in range(input_len)]
        text, ids = text_of_length(tokenizer, ids, input_len, rng, pool)
        requests.append(BenchRequest(text, ids, output_len))
    return requests


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every conversation with at least two turns.

    The file is a JSON list of `{"conversations": [{"from": ..., "value": ...}, ...]}`
    (ShareGPT_V3_unfiltered_cleaned_split.json and its subsets).
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value"), turns[1].get("value")
        if isinstance(prompt, str) and isinstance(reply, str):
            pairs.append((prompt, reply))
    return pairs


def sharegpt_requests(tokenizer: Any, path: str, num: int, seed: int,
                      output_len: int | None = None) -> list[BenchRequest]:
    """`num` conversations, shuffled by `seed`, that pass vLLM's length filters.

    The output length is the reply's token count unless `output_len` fixes it
    (vLLM's `--sharegpt-output-len`). Fewer valid conversations than `num` is an
    error: a benchmark that quietly sends fewer requests reports the wrong thing.
    """
    pairs = load_sharegpt(path)
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, reply in pairs:
        if len(requests) == num:
            break
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        out_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if not is_valid_sequence(len(ids), out_len, check_output_len=output_len is None):
            continue
        requests.append(BenchRequest(prompt, ids, out_len))
    if len(requests) < num:
        raise ValueError(f"{path}: only {len(requests)} usable conversations, "
                         f"--num-prompts asks for {num}")
    return requests


def is_valid_sequence(prompt_len: int, output_len: int, check_output_len: bool = True) -> bool:
    """vLLM's filter; a fixed output length skips the minimum-output check, as there."""
    return (prompt_len >= MIN_SEQ_LEN and (output_len >= MIN_SEQ_LEN or not check_output_len)
            and prompt_len <= MAX_PROMPT_LEN and prompt_len + output_len <= MAX_TOTAL_LEN)


def arrival_times(num: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent (non-decreasing).

    The first request goes at 0; each gap is Gamma(shape=burstiness,
    scale=1/(rate*burstiness)), whose mean is 1/rate; shape 1 is the exponential
    gap of a Poisson process, lower shapes are burstier, higher ones steadier.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    times, now = [], 0.0
    for i in range(num):
        if i:
            now += rng.gammavariate(burstiness, scale)
        times.append(now)
    return times

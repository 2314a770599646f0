"""Build a step's `SamplingMetadata` from the rows that sample this step.

The model runner calls this once per step. Every optional field stays `None` (or
empty) when no row needs it, which is what lets the sampler take its fast path:
an all-greedy batch with no penalties, bias or min_tokens is a single argmax.
"""

from __future__ import annotations

import torch

from pagoda.sample.metadata import SamplingMetadata
from pagoda.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A private generator for one seeded request; it lives as long as the request.

    It must be created on the device the sampler runs on (a CUDA generator for
    CUDA logits), since the sampler draws the request's noise with it.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: dict[int, torch.Generator],
    vocab_size: int,
    eos_token_ids: list[list[int]],
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """Row i of the result describes `params[i]`; all list arguments are row-aligned.

    `generators` maps row index -> that row's request generator (seeded requests only).
    Greedy rows are stored with temperature 0 and neutral top-k/top-p/min-p, so a
    truncation tensor exists only when some *random* row uses it. Token ids outside
    [0, vocab_size) in stop ids, logit_bias or bad words are dropped: such a token can
    never be sampled, so suppressing or biasing it changes nothing (an allowed id outside
    the vocabulary is dropped too: it could never be sampled either).
    """
    num_rows = len(params)
    if not (len(prompt_token_ids) == len(output_token_ids) == len(eos_token_ids) == num_rows):
        raise ValueError("params, prompt_token_ids, output_token_ids and eos_token_ids "
                         "must have one entry per row.")
    greedy = [p.is_greedy for p in params]
    temperatures = [0.0 if g else p.temperature for p, g in zip(params, greedy)]
    random_params = [p for p, g in zip(params, greedy) if not g]
    no_penalties = all(
        p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
        for p in params
    )

    def penalty(values: list[float]) -> torch.Tensor | None:
        return None if no_penalties else torch.tensor(values, dtype=torch.float32, device=device)

    return SamplingMetadata(
        temperature=torch.tensor(temperatures, dtype=torch.float32, device=device),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=_truncation(params, greedy, "top_p", 1.0, torch.float32, device,
                          any(p.top_p < 1.0 for p in random_params)),
        top_k=_truncation(params, greedy, "top_k", vocab_size, torch.int64, device,
                          any(0 < p.top_k < vocab_size for p in random_params)),
        min_p=_truncation(params, greedy, "min_p", 0.0, torch.float32, device,
                          any(p.min_p > 0.0 for p in random_params)),
        generators={row: gen for row, gen in generators.items() if not greedy[row]},
        no_penalties=no_penalties,
        presence_penalties=penalty([p.presence_penalty for p in params]),
        frequency_penalties=penalty([p.frequency_penalty for p in params]),
        repetition_penalties=penalty([p.repetition_penalty for p in params]),
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids,
        min_tokens=_min_tokens(params, output_token_ids, eos_token_ids, vocab_size),
        logit_bias=_logit_bias(params, vocab_size),
        allowed_token_ids=_allowed_token_ids(params, vocab_size),
        bad_words_token_ids={row: words for row, p in enumerate(params)
                             if (words := _in_vocab_words(p.bad_words_token_ids, vocab_size))},
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
    )


def _truncation(params, greedy, name, neutral, dtype, device, used) -> torch.Tensor | None:
    """Per-row top-k / top-p / min-p, neutral for greedy rows; None when unused."""
    if not used:
        return None
    values = []
    for p, is_greedy in zip(params, greedy):
        value = getattr(p, name)
        if name == "top_k" and not 0 < value < neutral:
            value = neutral  # 0 (disabled) or >= vocab: keep every token
        values.append(neutral if is_greedy else value)
    return torch.tensor(values, dtype=dtype, device=device)


def _min_tokens(params, output_token_ids, eos_token_ids, vocab_size):
    """Rows still short of min_tokens -> the ids that would end them too early.

    Those are the stop_token_ids and, unless ignore_eos (EOS then ends nothing), the
    EOS ids, as in vLLM.
    """
    result: dict[int, tuple[int, set[int]]] = {}
    for row, p in enumerate(params):
        if len(output_token_ids[row]) >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids.update(eos_token_ids[row])
        stop_ids = {t for t in stop_ids if 0 <= t < vocab_size}
        if stop_ids:
            result[row] = (p.min_tokens, stop_ids)
    return result


def _logit_bias(params, vocab_size):
    result: dict[int, dict[int, float]] = {}
    for row, p in enumerate(params):
        if not p.logit_bias:
            continue
        bias = {int(t): float(b) for t, b in p.logit_bias.items() if 0 <= int(t) < vocab_size}
        if bias:
            result[row] = bias
    return result


def _allowed_token_ids(params, vocab_size):
    result: dict[int, list[int]] = {}
    for row, p in enumerate(params):
        if p.allowed_token_ids:
            result[row] = [t for t in p.allowed_token_ids if 0 <= t < vocab_size]
    return result


def _in_vocab_words(words, vocab_size) -> list[list[int]]:
    return [w for w in words or () if w and all(0 <= t < vocab_size for t in w)]

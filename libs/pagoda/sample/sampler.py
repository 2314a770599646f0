"""The sampler: one next token per row from the model's last-position logits.

Order of operations (vLLM v1's, with its default `raw_logprobs` mode):

  1. logprobs, when requested, from the raw logits (before anything below);
  1b. the engine's custom logits processors (`logits_processors`), on a copy;
  2. allowed_token_ids, bad_words, logit_bias, then min_tokens suppression of
     stop/EOS ids;
  3. repetition, frequency and presence penalties;
  4. greedy rows: argmax of the logits so far;
  5. random rows: temperature, top-k, top-p, min-p, then the exponential race
     argmax(probs / E) with E ~ Exponential(1) drawn per row (E = -ln U). On the CPU
     with Pagoda's kernels loaded the race runs as one pass in the log domain,
     argmax(l - ln E) over the truncated logits l (`pagoda.kernels.cpu.race_argmax`):
     the same distribution from the same draws, without the softmax and four more
     passes over the vocabulary.

A seeded row draws E only from its own generator and every step is row-wise, so a
seeded request samples the same tokens whatever else shares the batch (and at
whatever row index). Unseeded rows draw from torch's default generator.

Invariant: a seeded random row draws exactly one `uniform_` of vocab_size floats from
its generator per sampled token, and nothing else ever draws from it (greedy rows
never do). So "the generator after k tokens" is well defined, and a request resumed
elsewhere after k tokens (migration) continues its stream once its fresh generator
has been advanced by the same k draws (`advance_generator`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels import cpu as cpu_kernels
from pagoda.sample.logprobs import LogprobsTensors, compute_topk_logprobs
from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.penalties import apply_penalties
from pagoda.sample.processors import (apply_allowed_token_ids, apply_bad_words, apply_logit_bias,
                                      apply_min_tokens)
from pagoda.sample.truncation import apply_min_p, apply_temperature, apply_top_k, apply_top_p
from pagoda.sampling_params import GREEDY_TEMPERATURE_EPS


@dataclass
class SamplerOutput:
    """Row i belongs to row i of the logits / metadata."""

    sampled_token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: LogprobsTensors | None  # [B, max_num_logprobs + 1]; None if no row asked


class Sampler:
    """Stateless; one instance serves every step. Never modifies the input logits."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()  # no copy when already float32
        raw = logits  # logprobs come from the logits before any processing (vLLM's raw mode)
        if metadata.custom_logits is not None:
            logits = metadata.custom_logits(logits.clone())
        if needs_processing(metadata):
            sampled = self.sample(self.process_logits(logits, metadata), metadata)
        elif metadata.all_greedy:
            sampled = logits.argmax(dim=-1)  # the per-decode-step fast path
        else:
            sampled = self.sample(logits, metadata)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = compute_topk_logprobs(raw, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 2-3 on a private contiguous copy: the logits greedy rows argmax over."""
        logits = logits.clone(memory_format=torch.contiguous_format)
        apply_allowed_token_ids(logits, metadata)
        apply_bad_words(logits, metadata)
        apply_logit_bias(logits, metadata)
        apply_min_tokens(logits, metadata)
        return apply_penalties(logits, metadata)

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 4-5: greedy rows take the argmax, random rows run the race."""
        if metadata.all_greedy:
            return logits.argmax(dim=-1)
        if metadata.all_random:
            return random_sample(logits, metadata, rows=None)
        sampled = logits.argmax(dim=-1)
        rows = [row for row, t in enumerate(metadata.temperature.tolist())
                if t >= GREEDY_TEMPERATURE_EPS]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sampled[index] = random_sample(logits[index], metadata, rows)
        return sampled


def needs_processing(metadata: SamplingMetadata) -> bool:
    """Whether any row has allowed_token_ids, bad words, logit_bias, min_tokens or a
    penalty to apply."""
    return (bool(metadata.allowed_token_ids) or bool(metadata.bad_words_token_ids)
            or bool(metadata.logit_bias) or bool(metadata.min_tokens) or not metadata.no_penalties)


def random_sample(logits: torch.Tensor, metadata: SamplingMetadata,
                  rows: list[int] | None) -> torch.Tensor:
    """Sample the random rows `rows` of the batch (None: all rows); `logits` holds them."""
    if rows is None:
        generators = metadata.generators
    else:
        generators = {i: metadata.generators[row] for i, row in enumerate(rows)
                      if row in metadata.generators}
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_kernels.available():
        truncated = random_logits(logits, metadata, rows)
        return cpu_kernels.race_argmax(truncated, uniform_noise(truncated, generators))
    probs = random_probs(logits, metadata, rows)
    return probs.div_(exponential_noise(probs, generators)).argmax(dim=-1)


def random_probs(logits: torch.Tensor, metadata: SamplingMetadata,
                 rows: list[int] | None) -> torch.Tensor:
    """The distribution the random rows `rows` (None: all) sample from: temperature,
    top-k, top-p and min-p applied, then softmax. `logits` holds those rows."""
    return torch.softmax(random_logits(logits, metadata, rows), dim=-1)


def random_logits(logits: torch.Tensor, metadata: SamplingMetadata,
                  rows: list[int] | None) -> torch.Tensor:
    """`random_probs` before its softmax: temperature, top-k, top-p and min-p applied
    (truncated tokens at -inf), a new tensor."""
    index = None if rows is None else torch.tensor(rows, dtype=torch.long)

    def select(values: torch.Tensor | None) -> torch.Tensor | None:
        return values if values is None or index is None else values[index.to(values.device)]

    logits = apply_temperature(logits, select(metadata.temperature))
    top_k, top_p, min_p = select(metadata.top_k), select(metadata.top_p), select(metadata.min_p)
    if top_k is not None:
        apply_top_k(logits, top_k)
    if top_p is not None:
        apply_top_p(logits, top_p)
    if min_p is not None:
        apply_min_p(logits, min_p)
    return logits


def exponential_noise(like: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """E ~ Exponential(1), shaped like `like`; row i from generators[i] when present.

    Drawn as -ln(U), U ~ Uniform[0, 1): on a CPU, uniform_ + log_ is about 6x faster
    than Tensor.exponential_. U == 0 gives E = inf, so that token loses this draw
    (prob / inf = 0) and no NaN can arise; it happens with probability 2**-24 per
    entry and only ever removes a candidate, never picks a masked one.
    """
    return uniform_noise(like, generators).log_().neg_()


def uniform_noise(like: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """U ~ Uniform[0, 1), shaped like `like`: row i one `uniform_` from generators[i]
    when present (the module invariant), the other rows from the default generator."""
    noise = torch.empty_like(like)
    if len(generators) < like.shape[0]:
        noise.uniform_()
    for row, generator in generators.items():
        noise[row].uniform_(generator=generator)
    return noise


def advance_generator(generator: torch.Generator, num_tokens: int, vocab_size: int) -> None:
    """Put a seeded request's fresh generator where it is after sampling `num_tokens`
    tokens: the same draws `exponential_noise` makes for its row, one per token (see
    the module invariant), into a scratch row on the generator's device."""
    row = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_tokens):
        row.uniform_(generator=generator)

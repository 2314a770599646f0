"""Beam search with vLLM's algorithm and names (`vllm.beam_search`, `LLM.beam_search`).

One rule, used by the offline `LLM.beam_search` (entrypoints/beam_search.py) and by the
gateway's `use_beam_search` (services/gateway/generation/beam_search.py), so both give
the same answer: each step every live beam runs as a one-token request with
`logprobs = 2 * beam_width` (`step_sampling_params`); every candidate it returns (the
sampled token and the top 2k) extends that beam. A candidate that is an EOS token (and
`ignore_eos` is off) is a finished hypothesis; the rest are sorted by score and the best
`beam_width` live on. After `max_tokens` steps (or when no beam is left) the finished
hypotheses and the live beams are sorted together and the best `beam_width` returned.
There is no early stop: every step runs, as in vLLM, which equals transformers'
`generate(num_beams=k, do_sample=False, early_stopping="never", length_penalty=0.0)`
(its "canonical beam search") whenever an EOS candidate that vLLM keeps is also one of
transformers' top `k` candidates of that step, and equals it for any `length_penalty`
and `early_stopping` with `ignore_eos` (no hypothesis finishes early).

Score (vLLM's `get_beam_search_score`): `cum_logprob / len(tokens) ** length_penalty`,
where `tokens` holds the prompt and the generated tokens, less a final EOS.

KV sharing invariant: a beam's step request is its prompt plus its tokens, and the
engine's prefix cache (`pagoda.core.block_pool`: chained block hashes, ref counts)
hands every full block that beams have in common -- the prompt's, and the generated
prefix they share -- to all of them by reference (ref_cnt = number of beams), so
forking a beam never copies or recomputes a full block: a step holds the common full
blocks once plus, per beam, its own full generated blocks and one partial last block,
which is the only part written per beam (recomputed from its tokens: the copy-on-write
of a partial block). Without prefix caching (`enable_prefix_caching=False`) each beam
holds its own blocks. Tested in tests/entrypoints/test_llm_beam_search.py.

This module imports nothing but the standard library and `pagoda.sampling_params`
(the gateway uses it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pagoda.sampling_params import SamplingParams

# One step's candidates of one beam: token id -> its log-probability (None: the beam's
# request produced nothing, e.g. it was aborted; the beam ends there).
Candidates = dict[int, float]


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters. `beam_width`: how many beams live on each step and
    how many sequences come back; `max_tokens`: the steps run; `temperature`: that of the
    one-token step requests (0: greedy; the candidates' logprobs are the model's own
    either way, so it only changes which extra sampled token joins the top 2k).
    Invalid values raise ValueError naming the field."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check(isinstance(self.beam_width, int) and not isinstance(self.beam_width, bool)
               and self.beam_width >= 1, "beam_width",
               f"beam_width must be at least 1, got {self.beam_width}.")
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
               and self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0.0,
               "temperature", f"temperature must be non-negative, got {self.temperature}.")
        _check(isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty),
               "length_penalty", f"length_penalty must be a finite number, got "
                                 f"{self.length_penalty}.")


@dataclass
class BeamSearchSequence:
    """A beam: `tokens` holds the prompt and the generated tokens (vLLM's layout);
    `logprobs` one candidates dict per generated token; `text` is filled when returned."""

    tokens: list[int]
    logprobs: list[Any] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """One prompt's search: its live `beams` and its `completed` hypotheses."""

    def __init__(self, prompt_tokens: list[int], lora_request: Any = None) -> None:
        self.prompt_len = len(prompt_tokens)
        self.beams = [BeamSearchSequence(list(prompt_tokens), lora_request=lora_request)]
        self.completed: list[BeamSearchSequence] = []


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float,
                          eos_token_ids: Sequence[int], length_penalty: float = 1.0) -> float:
    """vLLM's: the cumulative logprob over the length (prompt included, a final EOS not)."""
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)


def create_sort_beams_key_function(eos_token_ids: Sequence[int], length_penalty: float
                                   ) -> Callable[[BeamSearchSequence], float]:
    eos = frozenset(eos_token_ids)
    return lambda beam: get_beam_search_score(beam.tokens, beam.cum_logprob, eos, length_penalty)


def step_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """The params of every beam's one-token step request (vLLM's): 2k candidates, so at
    least k survive even when k of them end in EOS (transformers' reason for 2k).
    EOS never stops the step request itself from reporting its candidates."""
    return SamplingParams(n=1, max_tokens=1, temperature=params.temperature,
                          logprobs=2 * params.beam_width, ignore_eos=True)


def expand_beams(instance: BeamSearchInstance, candidates: Sequence[Candidates | None],
                 params: BeamSearchParams, eos_token_ids: Sequence[int]) -> None:
    """One step: `candidates[i]` are the next tokens of `instance.beams[i]`. EOS
    candidates join `completed` (finish_reason "stop"); the best `beam_width` of the rest
    become the live beams. Ties keep the beams' and the candidates' order (a stable sort)."""
    eos = frozenset(eos_token_ids)
    live: list[BeamSearchSequence] = []
    for beam, cands in zip(instance.beams, candidates):
        if cands is None:
            continue
        for token_id, logprob in cands.items():
            child = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [cands],
                                       beam.cum_logprob + logprob, lora_request=beam.lora_request)
            if token_id in eos and not params.ignore_eos:
                child.finish_reason, child.stop_reason = "stop", token_id
                instance.completed.append(child)
            else:
                live.append(child)
    key = create_sort_beams_key_function(eos, params.length_penalty)
    instance.beams = sorted(live, key=key, reverse=True)[:params.beam_width]


def best_beams(instance: BeamSearchInstance, params: BeamSearchParams,
               eos_token_ids: Sequence[int]) -> list[BeamSearchSequence]:
    """The finished hypotheses and the live beams, best `beam_width` first; a live beam
    ends "length"."""
    for beam in instance.beams:
        beam.finish_reason = beam.finish_reason or "length"
    key = create_sort_beams_key_function(eos_token_ids, params.length_penalty)
    return sorted(instance.completed + instance.beams, key=key, reverse=True)[:params.beam_width]


def generated_tokens(beam: BeamSearchSequence, prompt_len: int, params: BeamSearchParams
                     ) -> list[int]:
    """What a served choice shows: the generated tokens, less the EOS that finished the
    beam unless `include_stop_str_in_output` (Pagoda's rule for a stop token's text)."""
    tokens = beam.tokens[prompt_len:]
    if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
        tokens = tokens[:-1]
    return tokens


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(message)

"""The scheduler's side of speculation: who may get drafts, and what was accepted."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.spec_decode.ngram_proposer import NgramProposer

if TYPE_CHECKING:
    from pagoda.core.request import Request


def make_proposer(config: SpeculativeConfig | None) -> NgramProposer | None:
    """The scheduler's proposer; None without speculation or with a draft model or MTP
    (their drafts come from the worker: spec_decode.draft_model, spec_decode.mtp)."""
    if config is None or config.drafts_on_worker:
        return None
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                         config.prompt_lookup_max)


def may_speculate(request: Request) -> bool:
    """Whether drafts can be verified for this request with its output unchanged in
    distribution. Not for: a structured-output request (its matcher would have to
    advance through drafts it may roll back), a seeded random request (its generator
    draws one row per token: `pagoda.sample.sampler`'s invariant, which migration
    relies on), a pooling request."""
    params = request.sampling_params
    if request.structured_output_request is not None or request.pooling_params is not None:
        return False
    return params.seed is None or params.is_greedy


@dataclass
class SpecDecodingStats:
    """Cumulative counts, as vLLM's `vllm:spec_decode_*` counters report them.

    Invariants: num_accepted_tokens <= num_draft_tokens; accepted_per_pos[i] counts
    the drafts accepted at position i (0-based), so their sum is num_accepted_tokens.
    """

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def for_config(cls, config: SpeculativeConfig | None) -> "SpecDecodingStats | None":
        if config is None:
            return None
        k = config.num_speculative_tokens
        return cls(k, accepted_per_pos=[0] * k)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request verified `num_draft_tokens` drafts and accepted the first
        `num_accepted` of them."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_pos[position] += 1

    def snapshot(self) -> "SpecDecodingStats":
        return replace(self, accepted_per_pos=list(self.accepted_per_pos))

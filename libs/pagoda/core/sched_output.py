"""What the scheduler sends the worker each step: a plan made of diffs.

A request's prompt, sampling params and block ids travel once (`NewRequestData`);
afterwards only its new block ids travel (`CachedRequestData`). The worker keeps
its own persistent copy of every running request, appends the tokens it samples
itself, and forgets a request when its id shows up in `finished_req_ids` or
`preempted_req_ids`. A preempted request that is resumed travels again as new.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen (or forgot on preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; empty for a fresh request.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """Requests the worker already holds, in column form."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's plan.

    Invariant: `num_scheduled_tokens` has one entry for every request in
    `scheduled_new_reqs` and `scheduled_cached_reqs`, and their sum is
    `total_num_scheduled_tokens` (<= max_num_batched_tokens).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)

    @classmethod
    def empty(cls) -> "SchedulerOutput":
        return cls([], CachedRequestData(), {}, 0)

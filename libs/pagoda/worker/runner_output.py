"""What the worker returns to the scheduler after a step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LogprobsLists:
    """Logprobs of sampled (or prompt) positions, one row per position.

    Row i: `token_ids[i]` = [chosen token, top-1, ..., top-k], `logprobs[i]` their
    log-probabilities, `ranks[i]` their ranks (1 = most likely) in the full vocabulary.
    """

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[list[int]] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """Per-step result, in the order of `req_ids`.

    `sampled_token_ids[i]` is empty for a request whose prefill is still partial
    (no token sampled this step) and holds one token otherwise.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # req_id -> logprobs of the token sampled this step (only if requested).
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # req_id -> logprobs of the prompt positions computed this step (only if requested).
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls([], [])

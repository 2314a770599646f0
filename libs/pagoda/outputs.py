"""Request outputs shaped like vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's candidates: token id -> Logprob (the sampled token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request; `text` is the detokenized `token_ids`
    with any stop string removed (unless `include_stop_str_in_output`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything produced so far for one request; `finished` once all its completions are."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

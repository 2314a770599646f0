"""Request outputs shaped like vLLM's: `RequestOutput` / `CompletionOutput` for generation,
`PoolingRequestOutput` and its typed forms for pooling models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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


# ---------------------------------------------------------------- pooling models
# vLLM's pooling outputs (`vllm.outputs`): a request's result is `outputs`, typed by
# the call that made it (`LLM.encode`, `.embed`, `.classify`, `.score`).


@dataclass
class PoolingOutput:
    """The pooled vector of one request, as a 1-D float32 torch tensor ([tokens, dim]
    for a late-interaction model's token_embed)."""

    data: Any  # torch.Tensor (torch is imported only where outputs are made)


@dataclass
class EmbeddingOutput:
    """One embedding; its length is the model's hidden size (or the requested `dimensions`)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """Class probabilities (or logits without activation), one per label."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """The similarity score of a text pair."""

    score: float


@dataclass
class PoolingRequestOutput:
    """What a pooling request produced (vLLM's `PoolingRequestOutput`): `outputs` is a
    `PoolingOutput` from `LLM.encode`, or the typed output of the subclasses below."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    """`outputs` is an `EmbeddingOutput` (`LLM.embed`)."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()),
                   output.prompt_token_ids, output.num_cached_tokens, output.finished)


class ClassificationRequestOutput(PoolingRequestOutput):
    """`outputs` is a `ClassificationOutput` (`LLM.classify`)."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(output.request_id, ClassificationOutput(output.outputs.data.tolist()),
                   output.prompt_token_ids, output.num_cached_tokens, output.finished)


class ScoringRequestOutput(PoolingRequestOutput):
    """`outputs` is a `ScoringOutput` (`LLM.score`)."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "ScoringRequestOutput":
        data = output.outputs.data.reshape(-1)
        if data.numel() != 1:
            raise ValueError(f"A score is one number; the model returned {data.numel()}")
        return cls(output.request_id, ScoringOutput(float(data[0])), output.prompt_token_ids,
                   output.num_cached_tokens, output.finished)

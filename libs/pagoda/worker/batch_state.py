"""The worker's persistent copy of each request it is running."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.lora.request import LoRARequest
from pagoda.messages import NewRequestData
from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """Invariant: `token_ids == prompt_token_ids + output_token_ids`, and the worker
    appends each token it samples itself, so the scheduler never re-sends tokens."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None  # a pooling request: pooled, never sampled
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    # This step's draft tokens (speculative decoding), verified after the known tokens;
    # set from each plan, never appended to `token_ids` (only emitted tokens are).
    spec_token_ids: list[int] = field(default_factory=list)
    # The prompt's media items (placeholder runs and encoder inputs), sorted by offset.
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # Identifiers of those items this request already looked up in the encoder cache
    # (the lookup is counted once per request and item, not once per chunk).
    mm_looked_up: set[str] = field(default_factory=set)
    # M-RoPE models (Qwen2-VL): the prompt's [3, L] positions and the generated tokens'
    # offset, computed once (`mm_inputs.MultiModalStepInputs.positions`).
    mrope: tuple | None = None

    @classmethod
    def from_new(cls, data: NewRequestData, generator: torch.Generator | None) -> "CachedRequestState":
        state = cls(data.req_id, list(data.prompt_token_ids), list(data.output_token_ids),
                    data.sampling_params, list(data.block_ids), data.num_computed_tokens, generator,
                    pooling_params=data.pooling_params, lora_request=data.lora_request,
                    mm_features=list(data.mm_features))
        state.token_ids = state.prompt_token_ids + state.output_token_ids
        return state

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

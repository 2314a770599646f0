"""Per-step, per-row sampling inputs, built by the model runner from its batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    """Row i of every tensor belongs to the i-th request that samples this step.

    Invariants: `temperature[i] == 0` marks a greedy row; a row with an entry in
    `generators` draws its randomness only from that generator, so a seeded request
    samples the same tokens whatever else shares the batch.
    """

    temperature: torch.Tensor  # [B] float32; 0.0 = greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [B] float32, None when no row uses top-p
    top_k: torch.Tensor | None  # [B] int64 (vocab_size = disabled), None when unused
    min_p: torch.Tensor | None  # [B] float32, None when unused
    generators: dict[int, torch.Generator]
    # Penalties (None / True when no row uses any).
    no_penalties: bool
    presence_penalties: torch.Tensor | None  # [B]
    frequency_penalties: torch.Tensor | None  # [B]
    repetition_penalties: torch.Tensor | None  # [B]
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(default_factory=list)
    # Row -> (min_tokens, ids to suppress until then: EOS + stop_token_ids).
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    # Row -> {token id: bias}.
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    # Row -> the only token ids it may sample (vLLM's allowed_token_ids).
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Row -> its bad words as token sequences (vLLM's bad_words).
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    # Largest top-logprobs count requested by any row (None = no row wants logprobs).
    max_num_logprobs: int | None = None
    # The engine's custom logits processors (`sample.logits_processor_batch`), as one
    # function of the batch's logits; None: none are loaded.
    custom_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

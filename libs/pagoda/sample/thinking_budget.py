"""`thinking_token_budget` in the sampler's inputs: a row past its budget may only be
the end-of-thinking marker's next token (vLLM's ThinkingTokenBudgetLogitsProcessor).

Applied to every logits row of a step, a speculative step's included: row j of a
request with drafts is judged on prompt + output + its first j drafts, so a draft
that would cross the budget is rejected there and the forced token emitted instead;
the budget holds exactly with or without speculation (vLLM's bug #39573). The rule
itself is `pagoda.reasoning.budget.budget_state`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagoda.reasoning.budget import ReasoningConfig, budget_state
from pagoda.sampling_params import SamplingParams


def force_thinking_end(logits: torch.Tensor, rows: Sequence[tuple[SamplingParams, Sequence[int]]],
                       config: ReasoningConfig | None) -> None:
    """In place: each row whose request (`rows[i]`: its params and the tokens before
    that row's position) must write an end-marker token keeps only that token (its
    logit 0, every other -inf), so any temperature, penalty or top-k/p samples it."""
    if config is None:
        return
    forced_rows, forced_ids = [], []
    for i, (params, token_ids) in enumerate(rows):
        if params.thinking_token_budget is None:
            continue
        state = budget_state(token_ids, params.thinking_token_budget,
                             config.think_start_token_ids, config.think_end_token_ids)
        if state.forced is not None:
            forced_rows.append(i)
            forced_ids.append(state.forced)
    if not forced_rows:
        return
    index = torch.tensor(forced_rows, dtype=torch.long, device=logits.device)
    token = torch.tensor(forced_ids, dtype=torch.long, device=logits.device)
    logits[index] = float("-inf")
    logits[index, token] = 0.0

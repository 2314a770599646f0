"""Drafts never cross a thinking budget: the scheduler's half of enforcing
`thinking_token_budget` under speculative decoding.

The worker forces the end-of-thinking marker on every row, drafts included
(`pagoda.sample.thinking_budget`), which alone keeps the count exact; this hook also
cuts each request's drafts at the first position the budget forces, so no step
spends compute (and KV slots) verifying drafts that can only be rejected.

    after_step: the drafts just proposed (by `DraftTokens`, which runs before this
                hook) are cut to the request's free reasoning tokens
"""

from __future__ import annotations

from pagoda.core.request import Request
from pagoda.core.scheduler_hook import SchedulerHook
from pagoda.messages import ModelRunnerOutput
from pagoda.reasoning.budget import ReasoningConfig, budget_state


class ThinkingBudgetDrafts(SchedulerHook):
    """Invariant (after `after_step`): a request with a thinking budget has no draft at
    or past the position where its end marker is forced."""

    def __init__(self, config: ReasoningConfig) -> None:
        self.config = config

    def after_step(self, request: Request, runner_output: ModelRunnerOutput,
                   num_running: int) -> None:
        budget = request.sampling_params.thinking_token_budget
        if budget is None or not request.spec_token_ids:
            return
        state = budget_state(request.all_token_ids, budget, self.config.think_start_token_ids,
                             self.config.think_end_token_ids)
        if state.free is not None:
            request.spec_token_ids = request.spec_token_ids[:state.free]

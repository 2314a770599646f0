"""Draft tokens: speculative decoding's part in the scheduler's step.

After each step a decoding request may be given drafts (`Request.spec_token_ids`);
the next step schedules them after its one known-but-uncomputed token (they take
budget and KV slots like any token), the worker emits 1..k+1 tokens, and the computed
tokens of the rejected drafts are rolled back here (their KV slots are simply
rewritten later). Prefix-cache blocks only ever hash known tokens, so a draft never
reaches the cache.

    extra_tokens: a decode takes its drafts into the step, as far as the budget goes
    on_planned:   the drafts of the requests still planned go into the plan
    on_sampled:   the rejected drafts' computed tokens rolled back; acceptance counted
    after_step:   the next step's drafts proposed
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from pagoda.core.request import Request
from pagoda.core.scheduler_hook import SchedulerHook
from pagoda.messages import ModelRunnerOutput, SchedulerOutput
from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.spec_decode.stats import SpecDecodingStats, make_proposer, may_speculate

if TYPE_CHECKING:
    from pagoda.core.scheduler import SchedulerStats


class DraftTokens(SchedulerHook):
    """Invariant: outside `schedule()` a request's `spec_token_ids` are the drafts
    proposed for its next step; within it, once taken (`extra_tokens`), the drafts it
    verifies in this step, until the plan takes them (`on_planned`). A draft is
    verified in at most one step, and a preempted request loses its drafts."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = make_proposer(config)  # None with a draft model or MTP: the worker's
        self.stats = SpecDecodingStats.for_config(config)
        # A draft model (or MTP layer) writes KV for its proposals after each request's tokens.
        self.num_lookahead_tokens = config.num_speculative_tokens if config.drafts_on_worker else 0

    def extra_tokens(self, request: Request, num_new: int, budget: int) -> int:
        """Drafts ride only with a decode's one token, as many as the budget leaves;
        the others are dropped."""
        drafts = request.spec_token_ids
        if drafts and num_new == 1 == request.num_tokens - request.num_computed_tokens:
            request.spec_token_ids = drafts[:budget - 1]
        else:
            request.spec_token_ids = []
        return len(request.spec_token_ids)

    def on_preempted(self, request: Request) -> None:
        request.spec_token_ids = []

    def on_planned(self, output: SchedulerOutput, planned: Sequence[Request]) -> None:
        drafts = {}
        for request in planned:
            if request.spec_token_ids:
                drafts[request.request_id], request.spec_token_ids = request.spec_token_ids, []
        output.scheduled_spec_decode_tokens = drafts

    def on_sampled(self, request: Request, token_ids: list[int], plan: SchedulerOutput) -> None:
        """The worker emitted `token_ids` (its accepted drafts + one): roll the computed
        tokens back past the rejected drafts and count the acceptance."""
        drafts = plan.scheduled_spec_decode_tokens.get(request.request_id)
        if drafts is None or not token_ids:
            return
        num_drafts = len(drafts)
        num_accepted = min(len(token_ids) - 1, num_drafts)
        request.num_computed_tokens -= num_drafts - num_accepted
        self.stats.observe(num_drafts, num_accepted)

    def after_step(self, request: Request, runner_output: ModelRunnerOutput,
                   num_running: int) -> None:
        """Drafts for the request's next step: the n-gram proposer's, or the draft
        model's (MTP layer's) from the worker. None while the batch is too large for speculation to
        pay, or for requests it cannot serve (`may_speculate`)."""
        limit = self.config.disable_by_batch_size
        if (limit is not None and num_running >= limit) or not may_speculate(request):
            return
        # Room for the drafts and the token after them within max_tokens.
        room = request.max_tokens - request.num_output_tokens - 1
        if self.proposer is not None:
            request.spec_token_ids = self.proposer.propose(request.all_token_ids, room)
            return
        worker_drafts = runner_output.draft_token_ids.get(request.request_id)
        drafts = (worker_drafts or [])[:max(min(room, self.config.num_speculative_tokens), 0)]
        # The worker is not trusted blindly: drafts stop at the first impossible token.
        valid = next((i for i, t in enumerate(drafts) if not 0 <= t < self.config.vocab_size),
                     len(drafts))
        request.spec_token_ids = drafts[:valid]

    def add_stats(self, stats: SchedulerStats, running: Sequence[Request], waiting: Iterable[Request]) -> None:
        stats.spec_decoding = self.stats.snapshot()

"""How a feature takes part in scheduling without living in the scheduler.

A feature (structured outputs, speculative decoding, LoRA, ...) subclasses
`SchedulerHook` and overrides the few points it needs; the scheduler calls every
hook it was built with at each point, in their order. The defaults do nothing, so
a hook is only what its feature adds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from pagoda.core.request import Request
    from pagoda.core.scheduler import SchedulerStats
    from pagoda.messages import ModelRunnerOutput, SchedulerOutput


class SchedulerHook:
    """One feature's part in the scheduler's step.

    Contract: a hook changes only its own feature's state on a request (and what the
    method names as its result); the scheduler keeps the queues, the KV blocks, the
    token budget and the request's lifecycle. A hook never holds the scheduler's
    `running` or `waiting` themselves (step recovery swaps them): it is handed them.
    """

    # KV slots to reserve after each scheduled request's tokens (a draft model writes
    # its proposals there).
    num_lookahead_tokens: int = 0
    # True: `on_token` does nothing (returns True) for a request without a
    # `structured_output_request`, so the scheduler skips the call for those (it runs
    # for every sampled token of every request otherwise).
    on_token_constrained_only: bool = False

    # ------------------------------------------------------------ intake
    def on_add(self, request: Request) -> None:
        """A request arrives. ValueError refuses it (never queued: a 400)."""

    def admit(self, request: Request, running: Sequence[Request]) -> bool:
        """May the waiting `request` be given tokens now? False: it waits this step,
        in its place in the queue, and the requests behind it go ahead. To end it
        instead, set its finish_reason and return False: the scheduler frees it and
        reports it finished with no tokens."""
        return True

    def wait(self, waiting: Iterable[Request], timeout: float) -> None:
        """Nothing could run this step: block (at most `timeout` s) until something
        this hook refused to admit may be admitted."""

    # ------------------------------------------------------------ planning
    def limit_tokens(self, request: Request, start: int, num_new: int) -> int:
        """The request would be planned tokens [start, start + num_new); how many of them
        this feature allows this step (<= num_new; 0: none). Called once per request per
        plan, before the KV blocks are allocated."""
        return num_new

    def extra_tokens(self, request: Request, num_new: int, budget: int) -> int:
        """A running request is planned `num_new` tokens with `budget` left (its own
        tokens included); how many more this feature adds to them (<= budget - num_new)."""
        return 0

    def on_preempted(self, request: Request) -> None:
        """The request lost its blocks and computed tokens; it recomputes later."""

    def on_planned(self, output: SchedulerOutput, planned: Sequence[Request]) -> None:
        """The step's plan is final and the `planned` requests' computed tokens count
        its tokens: add this feature's fields to `output`."""

    # ------------------------------------------------------------ results
    def on_sampled(self, request: Request, token_ids: list[int], plan: SchedulerOutput) -> None:
        """The worker returned `token_ids` for `request` (not yet appended)."""

    def on_token(self, request: Request) -> bool:
        """The request's newest output token was appended (and did not stop it).
        False stops the request: the hook set its finish_reason."""
        return True

    def after_step(self, request: Request, runner_output: ModelRunnerOutput,
                   num_running: int) -> None:
        """The request got new tokens this step and runs on (`num_running` running)."""

    def add_stats(self, stats: SchedulerStats, running: Sequence[Request],
                  waiting: Iterable[Request]) -> None:
        """Fill in this feature's fields of a stats snapshot."""


def hooks_overriding(hooks: Sequence[SchedulerHook], method: str) -> list[SchedulerHook]:
    """The hooks (in order) whose class overrides `method`: the others would run the
    contract's no-op, so the scheduler's per-request-per-step loops skip them."""
    default = getattr(SchedulerHook, method)
    return [hook for hook in hooks if getattr(type(hook), method) is not default]

"""The grammar gate: structured outputs' part in the scheduler's step.

    on_add:     the constraint checked and its compile started; WAITING_FOR_GRAMMAR
    admit:      held back (the requests behind go ahead) until the grammar compiled;
                a grammar that failed to compile ends the request with an error
    on_planned: the bitmask rows of the constrained requests that sample this step
    on_token:   each accepted token advances the request's matcher
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler_hook import SchedulerHook
from pagoda.messages import FinishReason, SchedulerOutput
from pagoda.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("pagoda.core.scheduler")  # where these warnings always came from


def grammar_stop_token_ids(request: Request) -> list[int]:
    """The tokens that may end a complete answer: the model's EOS and the request's stop
    token ids. vLLM's grammars end at the tokenizer's EOS, which on gpt-oss is
    <|return|>; counting the stop tokens too lets a harmony chat (the gateway adds
    <|return|>/<|call|> to its stop_token_ids) end its constrained final message with
    <|return|> whatever the checkpoint names as EOS. A stop token is still allowed only
    where the grammar accepts the answer, so the output always satisfies it."""
    stop = request.sampling_params.stop_token_ids or []
    return sorted({*request.eos_token_ids, *stop})


class GrammarGate(SchedulerHook):
    """Invariant: a request with a constraint has a `structured_output_request`, and is
    admitted only once its grammar compiled (it then has a matcher). Without a manager
    (no backend), a constrained request is refused at intake."""

    on_token_constrained_only = True  # on_token returns True without a constraint

    def __init__(self, manager: StructuredOutputManager | None) -> None:
        self.manager = manager

    def on_add(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is None:
            return
        if self.manager is None:
            raise ValueError("structured_outputs: this engine has no structured-output backend.")
        request.structured_output_request = self.manager.init_request(
            request.sampling_params.structured_outputs, request.prompt_token_ids)
        request.status = RequestStatus.WAITING_FOR_GRAMMAR

    def admit(self, request: Request, running: Sequence[Request]) -> bool:
        """Give the request its matcher once the compile finished. A grammar that failed
        to compile ends the request (abort) instead of blocking the queue."""
        if request.status != RequestStatus.WAITING_FOR_GRAMMAR:
            return True
        error = self.manager.check_ready(
            request.structured_output_request, grammar_stop_token_ids(request),
            request.output_token_ids)
        if error is not None:
            logger.warning("request %s: %s", request.request_id, error)
            request.finish_reason = FinishReason.ABORT
            request.failure = error  # the client gets an error saying so, not a bare abort
            return False
        if request.structured_output_request.grammar is None:
            return False
        request.status = RequestStatus.WAITING
        return True

    def wait(self, waiting: Iterable[Request], timeout: float) -> None:
        """Block until a waiting request's grammar compiles, instead of spinning the
        step loop against the compile threads."""
        so_requests = [r.structured_output_request for r in waiting
                       if r.status == RequestStatus.WAITING_FOR_GRAMMAR]
        if so_requests:
            self.manager.wait_for_any(so_requests, timeout)

    def on_planned(self, output: SchedulerOutput, planned: Sequence[Request]) -> None:
        """The bitmask rows of the constrained requests that sample this step (their
        computed tokens caught up with their known tokens)."""
        rows = [r for r in planned
                if r.structured_output_request is not None and r.num_computed_tokens >= r.num_tokens
                and r.structured_output_request.constrains_next_token]
        if rows:
            output.structured_output_request_ids = [r.request_id for r in rows]
            output.grammar_bitmask = self.manager.grammar_bitmask(
                [r.structured_output_request for r in rows])

    def on_token(self, request: Request) -> bool:
        """Feed the request's new token to its matcher; False (and the request stops)
        once the grammar is complete or, which the bitmask prevents, refused it."""
        so_request = request.structured_output_request
        if so_request is None or so_request.grammar is None:
            return True
        if so_request.advance(request.output_token_ids):
            if not so_request.is_terminated:
                return True
        else:
            logger.warning("request %s: token %d is outside its grammar", request.request_id,
                           request.output_token_ids[-1])
        request.finish_reason, request.stop_reason = FinishReason.STOP, None
        return False

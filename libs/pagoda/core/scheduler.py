"""Continuous batching under a token budget, preemption by recompute.

One rule covers prefill, chunked prefill, decode and prefix hits: each step a
request is given `num_tokens - num_computed_tokens` tokens (capped by the
budget), i.e. its computed tokens catch up with its known tokens. A decode is a
request one token behind; a prefix hit starts with computed tokens > 0.

Order (`--scheduling-policy`, `request_queue.py`): waiting requests are admitted in the
queue's order (fcfs: arrival; priority: lowest value, then arrival), and under memory
pressure the running request that comes last in that order is preempted (fcfs: the
latest admitted; priority: highest value, latest arrival), even one already planned
this step, whose tokens then go back to the budget (vLLM's rule).

Structured outputs: a constrained request waits (WAITING_FOR_GRAMMAR) until its grammar
compiled, skipped over so the requests behind it are admitted meanwhile; each step's
plan carries the bitmask rows of the constrained requests that sample, and each
accepted token advances the request's matcher (`pagoda.structured_output`).

Speculative decoding (`--speculative-config`, `pagoda.spec_decode`): after each step a
decoding request may be given draft tokens (`Request.spec_token_ids`); the next step
schedules them after its one known-but-uncomputed token (they take budget and KV
slots like any token), the worker emits 1..k+1 tokens, and the computed tokens of the
rejected drafts are rolled back here (their KV slots are simply rewritten later).
Prefix-cache blocks only ever hash known tokens, so a draft never reaches the cache.

Pooling requests (`--runner pooling`) are prefills only: a pooling engine runs without
chunked prefill, so each is admitted with its whole remaining prompt, and it finishes
in the step that ran it, with the worker's pooled vector (`_finish_pooled`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, RequestStatus
from pagoda.core.request_queue import SchedulingPolicy, create_request_queue
from pagoda.messages import (CachedRequestData, EngineCoreOutput, EngineCoreRequest, FinishReason,
                             ModelRunnerOutput, NewRequestData, SchedulerOutput)
from pagoda.spec_decode.stats import SpecDecodingStats, make_proposer, may_speculate

if TYPE_CHECKING:
    from pagoda.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    """A snapshot for metrics, logs and load-aware routing."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_blocks: int
    num_free_blocks: int
    # vLLM's: adapter name -> running / waiting requests with it (empty without LoRA).
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    # Cumulative draft/acceptance counts under --speculative-config (None: off).
    spec_decoding: SpecDecodingStats | None = None


class Scheduler:
    """Owns the waiting and running queues and the KV cache manager of one replica.

    Invariant: a request is in exactly one of `waiting` or `running` until it
    finishes; a running request holds blocks for all its computed tokens.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size,
                                               cache_config.enable_prefix_caching,
                                               scheduler_config.max_model_len,
                                               cache_config.sliding_window)
        self.requests: dict[str, Request] = {}
        self.policy = SchedulingPolicy(scheduler_config.policy)
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Requests that ended since the last step: the worker drops their state.
        self._finished_req_ids: set[str] = set()
        self._pending_outputs: list[EngineCoreOutput] = []
        self.structured_output_manager = structured_output_manager
        spec = scheduler_config.speculative_config
        self.spec_proposer = make_proposer(spec)  # None with a draft model: the worker's
        self.spec_stats = SpecDecodingStats.for_config(spec)
        # A draft model writes KV for its proposals after each request's tokens.
        self.num_lookahead_tokens = (spec.num_speculative_tokens
                                     if spec is not None and spec.uses_draft_model else 0)

    # ------------------------------------------------------------------ intake
    def add_request(self, core_request: EngineCoreRequest) -> Request:
        if core_request.request_id in self.requests:
            raise ValueError(f"request id {core_request.request_id!r} is already in use")
        request = Request(core_request, self.block_size, self.cache_config.prefix_hash_seed,
                          self.config.max_model_len)
        if request.sampling_params.structured_outputs is not None:
            self._init_grammar(request)  # ValueError: an invalid constraint, never queued
        self.requests[request.request_id] = request
        self.waiting.add_request(request)
        return request

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> None:
        """End requests from outside the step (abort, stop string, client gone)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove_request(request)
            request.finish_reason = reason
            self._free_request(request)
            self._pending_outputs.append(EngineCoreOutput(
                request_id, [], finish_reason=reason, num_cached_tokens=max(request.num_cached_tokens, 0)))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}

        for request in list(self.running):
            if request.request_id in preempted:
                continue  # preempted earlier in this loop to make room
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                continue
            drafts, request.spec_token_ids = request.spec_token_ids, []
            if drafts and num_new == 1 == request.num_tokens - request.num_computed_tokens:
                drafts = drafts[:budget - 1]
                num_new += len(drafts)
            else:
                drafts = []
            new_blocks = self._allocate_or_preempt(request, num_new, preempted)
            budget += self._unschedule(preempted, num_scheduled, cached, spec_tokens)
            if new_blocks is None:
                continue  # the request itself was preempted
            if drafts:
                spec_tokens[request.request_id] = drafts
            budget -= num_new
            num_scheduled[request.request_id] = num_new
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append([b.block_id for b in new_blocks])
            cached.num_computed_tokens.append(request.num_computed_tokens)

        # Only admit waiting requests when nothing had to be preempted this step.
        skipped: list[Request] = []  # grammars still compiling: the rest go ahead
        while self.waiting and budget > 0 and not preempted \
                and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR \
                    and not self._grammar_ready(request):
                self.waiting.pop_request()
                if not request.is_finished:
                    skipped.append(request)
                continue
            if not self._lora_fits(request):  # waits for a running adapter to finish
                skipped.append(self.waiting.pop_request())
                continue
            hit_blocks, num_hit = [], 0
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - request.num_computed_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = self._cap(num_new, budget)
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, hit_blocks, num_hit, self.num_lookahead_tokens)
            if new_blocks is None:
                break
            self.waiting.pop_request()
            self.running.append(request)
            request.num_computed_tokens += num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            budget -= num_new
            num_scheduled[request.request_id] = num_new
            new_reqs.append(NewRequestData(
                request.request_id, request.prompt_token_ids, list(request.output_token_ids),
                request.sampling_params, self.kv_cache_manager.get_block_ids(request.request_id),
                request.num_computed_tokens, request.pooling_params,
                lora_request=request.lora_request))
        self.waiting.prepend_requests(skipped)

        output = SchedulerOutput(new_reqs, cached, num_scheduled, sum(num_scheduled.values()),
                                 self._finished_req_ids, preempted,
                                 scheduled_spec_decode_tokens=spec_tokens)
        self._finished_req_ids = set()
        for request_id, num in num_scheduled.items():
            self.requests[request_id].num_computed_tokens += num
        self._add_grammar_bitmask(output)
        return output

    def _lora_fits(self, request: Request) -> bool:
        """vLLM's rule: running requests use at most `max_loras` distinct adapters, so
        every step's adapters fit the worker's device slots."""
        lora, max_loras = request.lora_request, self.config.max_loras
        if lora is None or max_loras is None:
            return True
        held = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        return lora.lora_int_id in held or len(held) < max_loras

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        return self._cap(request.num_tokens - request.num_computed_tokens, budget)

    def _cap(self, num_new: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return max(min(num_new, budget), 0)

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: set[str]):
        """Allocate for `request`, preempting the lowest-priority running requests
        (fcfs: latest admitted; priority: highest value, latest arrival) until it
        fits. None if `request` itself was preempted."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = (max(self.running, key=lambda r: (r.priority, r.arrival_time))
                      if self.policy == SchedulingPolicy.PRIORITY else self.running[-1])
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    @staticmethod
    def _unschedule(preempted: set[str], num_scheduled: dict[str, int],
                    cached: CachedRequestData, spec_tokens: dict[str, list[int]]) -> int:
        """Take requests preempted after they were planned this step back out of the
        plan; the tokens they had, to return to the budget."""
        freed = 0
        for request_id in preempted & num_scheduled.keys():
            freed += num_scheduled.pop(request_id)
            spec_tokens.pop(request_id, None)
            i = cached.req_ids.index(request_id)
            for column in (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
                del column[i]
        return freed

    # ------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        now = time.time()
        self._finish_pooled(runner_output.pooler_output, outputs)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for req_id, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            if req_id in drafts and token_ids:
                self._settle_drafts(request, len(drafts[req_id]), len(token_ids))
            new_token_ids: list[int] = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                if request.check_stop() or not self._advance_grammar(request):
                    break
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if not new_token_ids and prompt_logprobs is None:
                continue
            if new_token_ids and request.first_token_time is None:
                request.first_token_time = now
            outputs.append(EngineCoreOutput(
                req_id, new_token_ids, runner_output.logprobs.get(req_id), prompt_logprobs,
                request.finish_reason, request.stop_reason, max(request.num_cached_tokens, 0)))
            if request.finish_reason is not None:
                self.running.remove(request)
                self._free_request(request)
            elif self.spec_stats is not None and new_token_ids:
                self._propose(request, runner_output.draft_token_ids.get(req_id))
        return outputs

    # ------------------------------------------------------------------ speculation
    def _settle_drafts(self, request: Request, num_drafts: int, num_emitted: int) -> None:
        """The worker emitted `num_emitted` tokens (its accepted drafts + one): roll the
        computed tokens back past the rejected drafts and count the acceptance."""
        num_accepted = min(num_emitted - 1, num_drafts)
        request.num_computed_tokens -= num_drafts - num_accepted
        self.spec_stats.observe(num_drafts, num_accepted)

    def _propose(self, request: Request, worker_drafts: list[int] | None) -> None:
        """Drafts for the request's next step: the n-gram proposer's, or the draft
        model's from the worker (`worker_drafts`). None while the batch is too large
        for speculation to pay, or for requests it cannot serve (`may_speculate`)."""
        spec = self.config.speculative_config
        limit = spec.disable_by_batch_size
        if (limit is not None and len(self.running) >= limit) or not may_speculate(request):
            return
        # Room for the drafts and the token after them within max_tokens.
        room = request.max_tokens - request.num_output_tokens - 1
        if self.spec_proposer is not None:
            request.spec_token_ids = self.spec_proposer.propose(request.all_token_ids, room)
            return
        drafts = (worker_drafts or [])[:max(min(room, spec.num_speculative_tokens), 0)]
        # The worker is not trusted blindly: drafts stop at the first impossible token.
        valid = next((i for i, t in enumerate(drafts) if not 0 <= t < spec.vocab_size),
                     len(drafts))
        request.spec_token_ids = drafts[:valid]

    # ------------------------------------------------------------------ grammars
    def _init_grammar(self, request: Request) -> None:
        if self.structured_output_manager is None:
            raise ValueError("structured_outputs: this engine has no structured-output backend.")
        request.structured_output_request = self.structured_output_manager.init_request(
            request.sampling_params.structured_outputs, request.prompt_token_ids)
        request.status = RequestStatus.WAITING_FOR_GRAMMAR

    def _grammar_ready(self, request: Request) -> bool:
        """Give the request its matcher once the compile finished. A grammar that failed
        to compile ends the request (abort) instead of blocking the queue."""
        error = self.structured_output_manager.check_ready(
            request.structured_output_request, request.eos_token_ids, request.output_token_ids)
        if error is not None:
            logger.warning("request %s: %s", request.request_id, error)
            request.finish_reason = FinishReason.ABORT
            self._free_request(request)
            self._pending_outputs.append(EngineCoreOutput(request.request_id, [],
                                                          finish_reason=FinishReason.ABORT))
            return False
        if request.structured_output_request.grammar is None:
            return False
        request.status = RequestStatus.WAITING
        return True

    def wait_for_grammars(self, timeout: float) -> None:
        """Nothing ran this step: block (at most `timeout` s) until a waiting request's
        grammar compiles, instead of spinning the step loop against the compile threads."""
        so_requests = [r.structured_output_request for r in self.waiting
                       if r.status == RequestStatus.WAITING_FOR_GRAMMAR]
        if so_requests:
            self.structured_output_manager.wait_for_any(so_requests, timeout)

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """The bitmask rows of the constrained requests that sample this step (their
        computed tokens caught up with their known tokens)."""
        rows = [r for r in map(self.requests.get, output.num_scheduled_tokens)
                if r.structured_output_request is not None and r.num_computed_tokens >= r.num_tokens
                and r.structured_output_request.constrains_next_token]
        if rows:
            output.structured_output_request_ids = [r.request_id for r in rows]
            output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(
                [r.structured_output_request for r in rows])

    def _advance_grammar(self, request: Request) -> bool:
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

    def _finish_pooled(self, pooler_output: dict[str, list[float]],
                       outputs: list[EngineCoreOutput]) -> None:
        """A pooling request ends in the step that ran its prompt, with its vector."""
        for req_id, vector in pooler_output.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            request.finish_reason = FinishReason.STOP
            outputs.append(EngineCoreOutput(req_id, [], finish_reason=FinishReason.STOP,
                                            num_cached_tokens=max(request.num_cached_tokens, 0),
                                            pooling_output=vector))
            self.running.remove(request)
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def get_stats(self) -> SchedulerStats:
        stats = self.kv_cache_manager.prefix_stats
        pool = self.kv_cache_manager.pool
        snapshot = SchedulerStats(len(self.running), len(self.waiting), pool.usage(),
                                  stats.queries, stats.hits, self.num_preemptions,
                                  pool.num_blocks, pool.num_free_blocks)
        snapshot.spec_decoding = self.spec_stats.snapshot() if self.spec_stats else None
        if self.config.max_loras is not None:
            snapshot.running_lora_adapters = _count_adapters(self.running)
            snapshot.waiting_lora_adapters = _count_adapters(self.waiting)
        return snapshot


def _count_adapters(requests) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts


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

Features hook into the step; they do not live here. Each is a `SchedulerHook`
(`scheduler_hook.py` states the contract) called at fixed points: on_add, admit, wait,
extra_tokens, on_preempted, on_planned, on_sampled, on_token, after_step, add_stats.
The grammar gate of structured outputs is `pagoda.structured_output.scheduler_hook`;
draft tokens of speculative decoding, `pagoda.spec_decode.scheduler_hook`; the
max_loras rule and adapter counts, `pagoda.lora.scheduler_hook`. A new feature (a
multimodal encoder budget) is one more hook in `feature_hooks`, at the same points.

Asynchronous onload (host/disk KV tiers, `--kv-offloading-onload async`, the default):
a waiting request whose prefix continues in a lower tier is given device blocks for
those hits (not offered to other requests: `delay_cache_blocks`), the copies go to the
worker in `kv_async_onloads`, and it leaves the queue (WAITING_FOR_REMOTE_KVS) without
taking budget, so the batch is not stalled. When the worker reports it in
`finished_recving` it goes back to the queue's head with its loaded blocks computed
(and offered as cached), from the first block any rank failed to fill
(`invalid_block_ids`) on recomputed, as vLLM's scheduler does with `load_kv_async`.
Invariants: its blocks are never freed while the copies may still write them (an abort
ends the request at once but frees its blocks only on the report), and the tier slots
and records it reads stay held (`kv_offload.py`).

Pooling requests (`--runner pooling`) are prefills only: a pooling engine runs without
chunked prefill, so each is admitted with its whole remaining prompt, and it finishes
in the step that ran it, with the worker's pooled vector (`_finish_pooled`).

Async scheduling (`SchedulerConfig.async_scheduling`): the next step is planned
before the last one's output is back; a request's tokens then include placeholders
for the tokens its steps in flight will sample. The reconciliation rules are stated
in `pagoda.engine.async_steps`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterable

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.encoder_budget import EncoderBudget
from pagoda.core.kv_offload import KVOffloadIndex, KVOffloadStats
from pagoda.core.media_guard import missing_encoder_input
from pagoda.core.request import Request, RequestStatus
from pagoda.core.request_queue import SchedulingPolicy, create_request_queue
from pagoda.core.scheduler_hook import SchedulerHook, hooks_overriding
from pagoda.lora.scheduler_hook import LoRAGate
from pagoda.messages import (CachedRequestData, EngineCoreOutput, EngineCoreRequest, FinishReason,
                             ModelRunnerOutput, NewRequestData, SchedulerOutput)
from pagoda.spec_decode.budget_cut import ThinkingBudgetDrafts
from pagoda.spec_decode.scheduler_hook import DraftTokens
from pagoda.spec_decode.stats import SpecDecodingStats
from pagoda.structured_output.manager import StructuredOutputManager
from pagoda.structured_output.scheduler_hook import GrammarGate


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
    # Cumulative host KV tier counters under --kv-offloading-size (None: off).
    kv_offload: KVOffloadStats | None = None
    kv_offload_disk: KVOffloadStats | None = None  # the disk tier below it (None: off)
    # The latest waits for asynchronous onloads: (sequence number, seconds), the
    # numbers counting every wait since start, so a reader records each wait once.
    kv_onload_waits: tuple[tuple[int, float], ...] = ()
    # Cumulative encoder cache lookups of media items and their hits (multi-modal models).
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0


def feature_hooks(config: SchedulerConfig,
                  structured_output_manager: StructuredOutputManager | None) -> list[SchedulerHook]:
    """The features' hooks, in the order the scheduler calls them (the first `admit`
    that refuses decides)."""
    hooks: list[SchedulerHook] = [GrammarGate(structured_output_manager)]
    if config.speculative_config is not None:
        hooks.append(DraftTokens(config.speculative_config))
        if config.reasoning_config is not None:  # after DraftTokens: it cuts their drafts
            hooks.append(ThinkingBudgetDrafts(config.reasoning_config))
    if config.max_loras is not None:
        hooks.append(LoRAGate(config.max_loras))
    if config.max_num_encoder_input_tokens:
        hooks.append(EncoderBudget(config.max_num_encoder_input_tokens))
    return hooks


class Scheduler:
    """Owns the waiting and running queues and the KV cache manager of one replica.

    Invariant: a request is in exactly one of `waiting` or `running` until it
    finishes; a running request holds blocks for all its computed tokens.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int,
                 structured_output_manager: StructuredOutputManager | None = None,
                 kv_offload: KVOffloadIndex | None = None) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size,
                                               cache_config.enable_prefix_caching,
                                               scheduler_config.max_model_len,
                                               cache_config.sliding_window,
                                               cache_config.num_state_checkpoints)
        # The host KV tier's index (--kv-offloading-size; kv_offload.py), None: off. It
        # takes no hit under a sliding window (released blocks would break the chain).
        self.kv_offload = kv_offload if cache_config.sliding_window is None else None
        self.onload_async = (self.kv_offload is not None
                             and cache_config.kv_offloading_onload == "async")
        # Requests whose asynchronous onloads are in flight (WAITING_FOR_REMOTE_KVS, or
        # FINISHED when aborted meanwhile: their blocks wait for the report).
        self.onloading: dict[str, Request] = {}
        # (sequence number, seconds) of the latest waits for onloads, for the wait
        # histogram (`SchedulerStats.kv_onload_waits`); `num_onload_waits` in all.
        self.onload_waits: collections.deque[tuple[int, float]] = collections.deque(maxlen=64)
        self.num_onload_waits = 0
        self.requests: dict[str, Request] = {}
        self.policy = SchedulingPolicy(scheduler_config.policy)
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.encoder_cache_queries = 0  # the worker's counts, summed (SchedulerStats)
        self.encoder_cache_hits = 0
        # Requests that ended since the last step: the worker drops their state.
        self._finished_req_ids: set[str] = set()
        self._pending_outputs: list[EngineCoreOutput] = []
        # Requests a hook ended with an error since `take_failed` (id -> why).
        self._failed: dict[str, str] = {}
        self.hooks = feature_hooks(scheduler_config, structured_output_manager)
        self.num_lookahead_tokens = sum(hook.num_lookahead_tokens for hook in self.hooks)
        # The hooks of the per-request-per-step calls that do something (the rest are
        # the contract's no-ops). `hooks` is fixed from here on.
        self._extra_tokens_hooks = hooks_overriding(self.hooks, "extra_tokens")
        self._limit_tokens_hooks = hooks_overriding(self.hooks, "limit_tokens")
        self._sampled_hooks = hooks_overriding(self.hooks, "on_sampled")
        self._token_hooks = hooks_overriding(self.hooks, "on_token")
        # Those that act on an unconstrained request's tokens too.
        self._any_token_hooks = [h for h in self._token_hooks
                                 if not h.on_token_constrained_only]
        self._after_step_hooks = hooks_overriding(self.hooks, "after_step")
        self.async_scheduling = scheduler_config.async_scheduling
        # Async: the requests each plan in flight ran (by id(plan)), so a token that
        # arrives for an id ended and reused meanwhile is never given to the newcomer.
        self._planned: dict[int, dict[str, Request]] = {}

    # ------------------------------------------------------------------ intake
    def add_request(self, core_request: EngineCoreRequest) -> Request:
        if core_request.request_id in self.requests:
            raise ValueError(f"request id {core_request.request_id!r} is already in use")
        request = Request(core_request, self.block_size, self.cache_config.prefix_hash_seed,
                          self.config.max_model_len, self.cache_config.prefix_caching_hash_algo)
        for hook in self.hooks:
            hook.on_add(request)  # ValueError: e.g. an invalid constraint, never queued
        self.requests[request.request_id] = request
        self.waiting.add_request(request)
        return request

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> None:
        """End requests from outside the step (abort, stop string, client gone)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # Copies may still be writing its blocks: they are freed on the report.
                request.finish_reason = reason
                request.status = RequestStatus.FINISHED
                del self.requests[request_id]
                self._pending_outputs.append(EngineCoreOutput(
                    request_id, [], finish_reason=reason, num_cached_tokens=0))
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
        return bool(self.waiting or self.running or self.onloading)

    def needs_worker(self, plan: SchedulerOutput) -> bool:
        """Whether `plan` must go to the worker though it may schedule no token: it
        carries tier copies, or onloads in flight wait for the worker's report."""
        return bool(plan.total_num_scheduled_tokens or self.onloading or plan.kv_offloads
                    or plan.kv_onloads or plan.kv_spills or plan.kv_disk_drops
                    or plan.kv_async_onloads)

    def wait_for_grammars(self, timeout: float) -> None:
        """Nothing ran this step: block (at most `timeout` s, per hook) until a request a
        hook holds back (a grammar still compiling) may be admitted, instead of
        spinning the step loop."""
        for hook in self.hooks:
            hook.wait(self.waiting, timeout)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        preempted: set[str] = set()
        pool = self.kv_cache_manager.pool
        checkpoints = self.kv_cache_manager.state_checkpoints
        if checkpoints is not None:
            checkpoints.start_step()
        if self.kv_offload is not None:  # blocks evicted while planning go to the tier
            pool.start_step()
            pool.offload_sink = self.kv_offload.offload
        try:
            # The running requests planned, in the plan's order (cached.req_ids').
            planned: list[Request] = []
            budget = self._schedule_running(num_scheduled, cached, preempted, planned)
            new_reqs: list[NewRequestData] = []
            if not preempted:  # only admit waiting requests when nothing had to be preempted
                self._schedule_waiting(budget, num_scheduled, new_reqs)
        finally:
            pool.offload_sink = None

        output = SchedulerOutput(new_reqs, cached, num_scheduled, sum(num_scheduled.values()),
                                 self._finished_req_ids, preempted)
        if self.kv_offload is not None:
            (output.kv_offloads, output.kv_onloads, output.kv_spills,
             output.kv_disk_drops) = self.kv_offload.take_ops()
            output.kv_async_onloads = self.kv_offload.take_async_onloads()
        self._finished_req_ids = set()
        requests = self.requests
        if checkpoints is not None:
            output.state_saves = self._plan_state_saves(num_scheduled, checkpoints)
        # One pass over the plan (it runs for every planned request every step): the
        # running ones, then the admitted ones (num_scheduled's order).
        planned.extend([requests[new.req_id] for new in new_reqs])
        if self.async_scheduling:
            self._planned[id(output)] = dict(zip(num_scheduled, planned))
            for request, num in zip(planned, num_scheduled.values()):
                num_computed = request.num_computed_tokens + num
                request.num_computed_tokens = num_computed
                # The step reaches the end of its tokens: it will sample one there.
                if num_computed >= len(request.all_token_ids) + request.num_output_placeholders:
                    request.num_output_placeholders += 1
        else:
            for request, num in zip(planned, num_scheduled.values()):
                request.num_computed_tokens += num
        for hook in self.hooks:
            hook.on_planned(output, planned)
        return output

    def _schedule_running(self, num_scheduled: dict[str, int], cached: CachedRequestData,
                          preempted: set[str], planned: list[Request]) -> int:
        """Plan the running requests in their order, preempting to make room; the
        budget left. `planned` gets the requests planned, in `cached.req_ids`' order."""
        budget = self.config.max_num_batched_tokens
        hooks = self._extra_tokens_hooks
        # Bound once: this loop runs for every running request every step.
        allocate = self.kv_cache_manager.allocate_slots
        # allocate_slots' first test, inline (a decode step whose tokens fit the blocks
        # the request holds, no block filled: nothing to allocate, release or cache).
        kv = self.kv_cache_manager
        held = kv.req_blocks if kv.sliding_window is None else {}
        num_cached_blocks, bs = kv.num_cached_blocks, kv.block_size
        lookahead = self.num_lookahead_tokens
        req_ids, new_block_ids = cached.req_ids, cached.new_block_ids
        num_computed = cached.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        async_scheduling = self.async_scheduling
        for request in list(self.running):
            request_id = request.request_id
            if preempted and request_id in preempted:
                continue  # preempted earlier in this loop to make room
            num_new = len(request.all_token_ids) - request.num_computed_tokens
            placeholders = request.num_output_placeholders
            if async_scheduling and placeholders:
                # Async scheduling: a request with tokens in flight is planned into the
                # next step now unless those tokens already bring it to `max_tokens` (or
                # the context: it ends there, and the step would be wasted) or it is
                # constrained (its grammar mask needs its last token).
                if (len(request.output_token_ids) + placeholders >= request.max_tokens
                        or request.structured_output_request is not None):
                    continue
                num_new += placeholders
            if 0 < threshold < num_new:  # self._cap, inline
                num_new = threshold
            if num_new > budget:
                num_new = budget
            for hook in self._limit_tokens_hooks:  # the encoder budget
                num_new = hook.limit_tokens(request, request.num_computed_tokens, num_new)
            if num_new <= 0:
                continue
            if hooks:
                extra = 0
                for hook in hooks:  # each sees the request's own tokens, not the others' extras
                    extra += hook.extra_tokens(request, num_new, budget)
                num_new += extra
            blocks = held.get(request_id)
            num_total = request.num_computed_tokens + num_new
            if (blocks is not None and -(-(num_total + lookahead) // bs) <= len(blocks)
                    and min(num_total, len(request.all_token_ids)) // bs
                    <= num_cached_blocks.get(request_id, 0)):
                block_ids = []
            else:
                new_blocks = allocate(request, num_new, num_lookahead_tokens=lookahead)
                if new_blocks is None:  # no room: preempt until it fits
                    new_blocks = self._allocate_or_preempt(request, num_new, preempted)
                    budget += self._unschedule(preempted, num_scheduled, cached, planned)
                    if new_blocks is None:
                        continue  # the request itself was preempted
                block_ids = [b.block_id for b in new_blocks] if new_blocks else []
            budget -= num_new
            num_scheduled[request_id] = num_new
            req_ids.append(request_id)
            new_block_ids.append(block_ids)
            num_computed.append(request.num_computed_tokens)
            planned.append(request)
        return budget

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          new_reqs: list[NewRequestData]) -> None:
        """Admit waiting requests in the queue's order while budget, sequences and
        blocks last. One a hook holds back is skipped: the requests behind it go ahead."""
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek_request()
            if request.num_output_placeholders:  # preempted with a step in flight:
                self.waiting.pop_request()       # it resumes once that token is known
                skipped.append(request)
                continue
            if not all(hook.admit(request, self.running) for hook in self.hooks):
                self.waiting.pop_request()
                if request.finish_reason is None:
                    skipped.append(request)
                else:  # the hook ended it (a grammar that failed to compile)
                    self._end_failed(request, request.failure)
                continue
            hit_blocks, num_hit = [], 0
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            tier_slots = self._host_tier_hits(request, len(hit_blocks))
            num_hit += len(tier_slots) * self.block_size
            num_new = request.num_tokens - request.num_computed_tokens - num_hit
            if request.mm_features:  # every token still to compute, checked at each admission
                why = missing_encoder_input(request.mm_features,
                                            request.num_computed_tokens + num_hit, num_new)
                if why is not None:  # a media item without data in it (media_guard.py)
                    if tier_slots:
                        self.kv_offload.unpin(tier_slots)
                    self.waiting.pop_request()
                    self._end_failed(request, why)
                    continue
            if tier_slots and self.onload_async:
                if not self._start_onload(request, hit_blocks, tier_slots):
                    break  # no room for its blocks now
                continue
            if not self.config.enable_chunked_prefill and num_new > budget:
                if tier_slots:
                    self.kv_offload.unpin(tier_slots)
                break
            num_new = self._cap(num_new, budget)
            if self._limit_tokens_hooks:
                num_new = self._limit(request, num_hit, num_new)
                if num_new <= 0:
                    if tier_slots:
                        self.kv_offload.unpin(tier_slots)
                    break
            # The tier's blocks get fresh device blocks: the first new ones.
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, hit_blocks, num_hit, self.num_lookahead_tokens)
            if new_blocks is None:
                if tier_slots:
                    self.kv_offload.unpin(tier_slots)
                if not self.running:  # nothing will free blocks: the queue must
                    self._release_onloaded_blocks(request)
                break
            request.holds_onloaded_blocks = False
            if tier_slots:
                self.kv_offload.plan_onloads(request.request_id, len(hit_blocks), tier_slots,
                                             [b.block_id for b in new_blocks[:len(tier_slots)]])
            self.waiting.pop_request()
            new_reqs.append(self._start_running(request, num_hit))
            budget -= num_new
            num_scheduled[request.request_id] = num_new
        self.waiting.prepend_requests(skipped)

    def _end_failed(self, request: Request, failure: str | None) -> None:
        """End a waiting request taken off the queue (ABORT unless a hook chose the
        reason); `failure` is what its caller is told (`take_failed`)."""
        if request.finish_reason is None:
            request.finish_reason = FinishReason.ABORT
        if failure is not None:
            request.failure = failure
            self._failed[request.request_id] = failure
        self._free_request(request)
        self._pending_outputs.append(EngineCoreOutput(
            request.request_id, [], finish_reason=request.finish_reason))

    def _start_onload(self, request: Request, hit_blocks, tier_slots) -> bool:
        """Give the request blocks for its device and tier hits, plan the tier blocks'
        asynchronous onloads and take it out of the queue until they are done; False
        (nothing changed, the tier's pins dropped) when the pool has no room."""
        bs = self.block_size
        num_device = len(hit_blocks) * bs
        # Only when the whole request would fit now, as the synchronous path admits it:
        # blocks held through a long onload must not push running requests out.
        needed = (-(-request.num_tokens // bs) - len(hit_blocks)
                  + sum(1 for b in hit_blocks if b.ref_cnt == 0))
        if self.kv_cache_manager.pool.num_free_blocks < needed:
            self.kv_offload.unpin(tier_slots)
            return False
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, len(tier_slots) * bs, hit_blocks, num_device, delay_cache_blocks=True)
        if new_blocks is None:
            self.kv_offload.unpin(tier_slots)
            return False
        self.kv_offload.plan_onloads(request.request_id, len(hit_blocks), tier_slots,
                                     [b.block_id for b in new_blocks[:len(tier_slots)]],
                                     asynchronous=True)
        self.waiting.pop_request()
        request.num_computed_tokens = num_device
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.onload = (len(hit_blocks), len(tier_slots), time.monotonic())
        self.onloading[request.request_id] = request
        return True

    def _finish_onloads(self, finished: set[str], invalid_block_ids: set[int]) -> None:
        """The worker (every rank) finished the onloads of `finished`: each goes back to
        the queue's head with its blocks up to the first invalid one computed; an
        aborted one frees its blocks now."""
        manager, bs = self.kv_cache_manager, self.block_size
        for request_id in finished:
            request = self.onloading.pop(request_id, None)
            if request is None:
                continue
            self.kv_offload.finish_onloads(request_id)
            first, count, started = request.onload
            request.onload = None
            blocks = manager.req_blocks.get(request_id, [])
            loaded = 0
            if not request.onload_void:
                while loaded < count and blocks[first + loaded].block_id not in invalid_block_ids:
                    loaded += 1
            if loaded < count:  # never hit that entry again: it would fail the same way
                self._forget_bad_tier_blocks(request, first + loaded, first + count,
                                             invalid_block_ids)
            if request.status == RequestStatus.FINISHED:  # aborted while it loaded
                manager.free(request)
                continue
            self.num_onload_waits += 1
            self.onload_waits.append((self.num_onload_waits, time.monotonic() - started))
            request.status = RequestStatus.WAITING
            if request.onload_void or first + loaded == 0:
                # Nothing usable (or the device cache was set up again): start afresh.
                request.onload_void = False
                manager.free(request)
                request.num_computed_tokens = 0
            else:
                manager.cache_loaded_blocks(request, first + loaded)
                request.num_computed_tokens = (first + loaded) * bs
                request.holds_onloaded_blocks = True
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = request.num_computed_tokens
            self.waiting.prepend_request(request)

    def _release_onloaded_blocks(self, head: Request) -> None:
        """Nothing runs and `head` does not fit: queued requests that hold the blocks
        their onloads filled (behind it, by priority or a preemption) give them back,
        still cached, so `head` can go; they find them again on the device (or in the
        tiers) when admitted. Without this the queue could wait on itself forever."""
        manager = self.kv_cache_manager
        for request in list(self.waiting):
            if request is not head and request.holds_onloaded_blocks:
                request.holds_onloaded_blocks = False
                manager.free(request)
                request.num_computed_tokens = 0

    def _forget_bad_tier_blocks(self, request: Request, start: int, end: int,
                                invalid_block_ids: set[int]) -> None:
        """Blocks `start..end-1` of `request` failed to onload (or were not tried after
        one that did): drop the tier entries of those that failed, unless another
        onload in flight still reads them, so the retry recomputes instead."""
        blocks = self.kv_cache_manager.req_blocks.get(request.request_id, [])
        for i in range(start, min(end, len(blocks))):
            if blocks[i].block_id in invalid_block_ids:
                self.kv_offload.forget(request.block_hashes[i])

    def void_onloads(self) -> None:
        """The worker's KV cache was set up again (a failed step): whatever the onloads
        in flight copy lands in a cache no longer used, and the device hits they
        continue are gone. Each such request starts afresh when reported; a queued one
        holding blocks its onload filled starts afresh now."""
        for request in self.onloading.values():
            request.onload_void = True
        for request in list(self.waiting):
            if request.holds_onloaded_blocks:
                request.holds_onloaded_blocks = False
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0

    def abandon_onloads(self, plan: SchedulerOutput) -> None:
        """`plan` was refused before any of it ran: its asynchronous onloads never
        started and will never be reported. Their requests start afresh."""
        for request_id in dict.fromkeys(op.req_id for op in plan.kv_async_onloads):
            request = self.onloading.pop(request_id, None)
            if request is None:
                continue
            self.kv_offload.finish_onloads(request_id)
            request.onload = None
            self.kv_cache_manager.free(request)
            if request.status == RequestStatus.FINISHED:
                continue
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = 0
            self.waiting.prepend_request(request)

    def _host_tier_hits(self, request: Request, num_device_hits: int) -> list[int]:
        """Host-tier slots of the blocks that follow the device hits of a request not
        yet started (pinned for this step); [] without a tier."""
        if (self.kv_offload is None or request.num_computed_tokens != 0
                or not self.kv_cache_manager.enable_caching
                or request.sampling_params.prompt_logprobs is not None):
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if num_device_hits >= max_hit_blocks:
            return []
        return self.kv_offload.lookup(request.block_hashes, request.all_token_ids,
                                      num_device_hits, max_hit_blocks, self.block_size)

    def _plan_state_saves(self, num_scheduled: dict[str, int], checkpoints
                          ) -> dict[str, tuple[int, int]]:
        """The requests whose step crosses their `state_save_at` boundary save their
        recurrent state there, unless that block's state is saved already (before the
        step's computed tokens are advanced)."""
        saves = {}
        bs = self.block_size
        for request_id, num in num_scheduled.items():
            request = self.requests[request_id]
            at, computed = request.state_save_at, request.num_computed_tokens
            if not at or not computed < at <= computed + num:
                continue
            block_hash = request.block_hashes[at // bs - 1]
            if checkpoints.has(block_hash):
                continue
            slot = checkpoints.reserve(block_hash)
            if slot is not None:
                saves[request_id] = (at - computed, slot)
        return saves

    def _start_running(self, request: Request, num_hit: int) -> NewRequestData:
        """The request was admitted with `num_hit` tokens found in the prefix cache;
        what the worker is sent of it."""
        self.running.append(request)
        request.num_computed_tokens += num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
        request.status = RequestStatus.RUNNING
        return NewRequestData(
            request.request_id, request.prompt_token_ids, list(request.output_token_ids),
            request.sampling_params, self.kv_cache_manager.get_block_ids(request.request_id),
            request.num_computed_tokens, request.pooling_params, lora_request=request.lora_request,
            mm_features=request.mm_features,
            state_restore=request.state_restore if num_hit else None)

    def _limit(self, request: Request, num_hit: int, num_new: int) -> int:
        """A waiting request's tokens after the features' limits (the encoder budget);
        0 when it must wait: nothing allowed, or, without chunked prefill, less than all."""
        wanted = num_new
        for hook in self._limit_tokens_hooks:
            num_new = hook.limit_tokens(request, request.num_computed_tokens + num_hit, num_new)
        if num_new < wanted and not self.config.enable_chunked_prefill:
            return 0
        return num_new

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
        """Back to the head of the queue, its blocks freed. Blocks past its computed
        tokens are taken out of the prefix cache: a request preempted after it was
        planned this step (the priority policy's victim may be) had its new full blocks
        offered as cached when they were allocated, and the step will not write them."""
        manager = self.kv_cache_manager
        unwritten = [b for b in manager.req_blocks.get(request.request_id, [])
                     [request.num_computed_tokens // self.block_size:] if b is not None]
        self.running.remove(request)
        manager.free(request)
        if unwritten:
            manager.pool.uncache_blocks(unwritten)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        for hook in self.hooks:
            hook.on_preempted(request)
        self.waiting.prepend_request(request)

    @staticmethod
    def _unschedule(preempted: set[str], num_scheduled: dict[str, int],
                    cached: CachedRequestData, planned: list[Request]) -> int:
        """Take requests preempted after they were planned this step back out of the
        plan; the tokens they had, to return to the budget."""
        freed = 0
        for request_id in preempted & num_scheduled.keys():
            freed += num_scheduled.pop(request_id)
            i = cached.req_ids.index(request_id)
            for column in (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                           planned):
                del column[i]
        return freed

    # ------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        if runner_output.finished_recving:
            self._finish_onloads(runner_output.finished_recving, runner_output.invalid_block_ids)
        outputs, self._pending_outputs = self._pending_outputs, []
        now = time.time()
        checkpoints = self.kv_cache_manager.state_checkpoints
        if checkpoints is not None:  # the step ran: the states it saved are there
            checkpoints.commit(self.kv_cache_manager.pool.is_cached)
        self.encoder_cache_queries += runner_output.num_encoder_cache_queries
        self.encoder_cache_hits += runner_output.num_encoder_cache_hits
        self._finish_pooled(runner_output.pooler_output, outputs)
        # Bound once: this loop runs for every sampled request every step.
        requests = self.requests
        sampled_hooks, token_hooks = self._sampled_hooks, self._token_hooks
        after_step_hooks = self._after_step_hooks
        logprobs, all_prompt_logprobs = runner_output.logprobs, runner_output.prompt_logprobs
        if self.async_scheduling:
            requests = self._planned.pop(id(scheduler_output), {})
        # No hook sees an unconstrained request's tokens and nobody asked for logprobs:
        # such a request's one sampled token takes the short path below (what the
        # general one does for it, minus the hook calls that would change nothing),
        # which every plain decode request takes every step.
        plain = not (sampled_hooks or self._any_token_hooks or logprobs
                     or all_prompt_logprobs)
        FINISHED = RequestStatus.FINISHED
        append_output = outputs.append
        for req_id, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = requests.get(req_id)
            if request is None or request.status is FINISHED:
                continue  # aborted while the step ran (or ended a step earlier: async)
            placeholders = request.num_output_placeholders
            if placeholders:  # async: the tokens replace placeholders
                placeholders -= len(token_ids)
                request.num_output_placeholders = placeholders if placeholders > 0 else 0
            if plain and len(token_ids) == 1 and request.structured_output_request is None:
                # The short path, whole: one token, no logprobs, no hook that cares.
                if request.first_token_time is None:
                    request.first_token_time = now
                request.append_token_and_check_stop(token_ids[0])
                finish_reason = request.finish_reason
                cached = request.num_cached_tokens
                append_output(EngineCoreOutput(req_id, [token_ids[0]], None, None, finish_reason,
                                               request.stop_reason, cached if cached > 0 else 0))
                if finish_reason is not None:
                    self._end_sampled(request)
                elif after_step_hooks:
                    for hook in after_step_hooks:
                        hook.after_step(request, runner_output, len(self.running))
                continue
            for hook in sampled_hooks:
                hook.on_sampled(request, token_ids, scheduler_output)
            new_token_ids = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                if request.check_stop():
                    break
                stopped = False  # a hook ended the request (its grammar completed)
                for hook in token_hooks:
                    if not hook.on_token(request):
                        stopped = True
                        break
                if stopped:
                    break
            prompt_logprobs = (all_prompt_logprobs.get(req_id) if all_prompt_logprobs
                               else None)
            if not new_token_ids and prompt_logprobs is None:
                continue
            if new_token_ids and request.first_token_time is None:
                request.first_token_time = now
            append_output(EngineCoreOutput(
                req_id, new_token_ids, logprobs.get(req_id) if logprobs else None,
                prompt_logprobs, request.finish_reason, request.stop_reason,
                max(request.num_cached_tokens, 0)))
            if request.finish_reason is not None:
                self._end_sampled(request)
            elif new_token_ids:
                for hook in after_step_hooks:
                    hook.after_step(request, runner_output, len(self.running))
        return outputs

    def _end_sampled(self, request: Request) -> None:
        """A request its step's tokens ended: off the running list (or, async, the
        waiting queue, when it was preempted after this step was planned), and freed."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove_request(request)
        self._free_request(request)

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

    def discard_plan(self, plan: SchedulerOutput) -> None:
        """Async: a plan whose output will never be applied (a failed step)."""
        self._planned.pop(id(plan), None)

    def unsend(self, plan: SchedulerOutput) -> None:
        """A plan that scheduled nothing is not sent: the ended requests it would have
        told the worker about go with the next plan instead."""
        self._finished_req_ids |= plan.finished_req_ids
        self.discard_plan(plan)

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def take_failed(self) -> dict[str, str]:
        """Requests a hook ended with an error since the last call (id -> why)."""
        failed, self._failed = self._failed, {}
        return failed

    def get_stats(self) -> SchedulerStats:
        stats = self.kv_cache_manager.prefix_stats
        pool = self.kv_cache_manager.pool
        snapshot = SchedulerStats(len(self.running), len(self.waiting), pool.usage(),
                                  stats.queries, stats.hits, self.num_preemptions,
                                  pool.num_blocks, pool.num_free_blocks,
                                  encoder_cache_queries=self.encoder_cache_queries,
                                  encoder_cache_hits=self.encoder_cache_hits)
        if self.kv_offload is not None:
            snapshot.kv_offload = dataclasses.replace(self.kv_offload.stats)
            if self.kv_offload.disk_stats is not None:
                snapshot.kv_offload_disk = dataclasses.replace(self.kv_offload.disk_stats)
            snapshot.kv_onload_waits = tuple(self.onload_waits)
        for hook in self.hooks:
            hook.add_stats(snapshot, self.running, self.waiting)
        return snapshot

"""The engine core: a scheduler and an executor, stepped in a loop."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from typing import Callable, Iterable

from pagoda.config import EngineConfig
from pagoda.core.kv_events import KVEvent
from pagoda.messages import (EngineCoreOutput, EngineCoreRequest, FinishReason, ModelRunnerOutput,
                             SchedulerOutput)
from pagoda.core.kv_offload import KVOffloadIndex
from pagoda.core.scheduler import Scheduler, SchedulerStats
from pagoda.core import step_quarantine
from pagoda.core.step_recovery import reject_step
from pagoda.engine.async_steps import MAX_STEPS_IN_FLIGHT, SerialExecutor
from pagoda.engine.worker_control import SleepStatus
from pagoda.executor.base import Executor, StepFailed, StepRejected, WorkerGroupFailed
from pagoda.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)
# How long a step that ran nothing waits for a compiling grammar before looking again
# (new requests and aborts are applied between steps, so keep it short).
GRAMMAR_WAIT_S = 0.01


class EngineCore:
    """Token ids in, token ids out. Not thread-safe: drive it from one thread.

    Invariant: every accepted request eventually yields exactly one output with a
    `finish_reason` (stop, length or abort).
    """

    def __init__(self, config: EngineConfig, executor: Executor,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        self.config = config
        # Async scheduling: every executor call goes through one thread, in order, and
        # steps are submitted without waiting (`_step_async`).
        self.async_scheduling = config.scheduler.async_scheduling
        if self.async_scheduling:
            executor = SerialExecutor(executor)
        self.executor = executor
        self._in_flight: collections.deque[tuple[SchedulerOutput, concurrent.futures.Future]] = \
            collections.deque()
        num_blocks = config.cache.num_gpu_blocks_override or executor.determine_num_blocks()
        executor.initialize_kv_cache(num_blocks)
        config.cache.num_blocks = num_blocks
        self.structured_output_manager = (structured_output_manager
                                          or make_structured_output_manager(config))
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks,
                                   self.structured_output_manager, make_kv_offload_index(config))
        # The plan of the latest `step` (None if it scheduled nothing), for metrics
        # and tracing: which requests ran, how many tokens, which were preempted.
        self.last_scheduler_output: SchedulerOutput | None = None
        # Requests the worker refused since `take_rejected` (id -> why): they end ABORT
        # in the outputs; the caller tells their clients why (step_recovery.py).
        self.rejected: dict[str, str] = {}
        self._suspects = False  # requests of a failed step still run alone (quarantine)
        # Set when the executor can run no more steps (a worker group that failed for
        # good): every later step raises it, rather than plan steps that never run.
        self.failure: WorkerGroupFailed | None = None
        # Called on this thread once the worker's KV cache was set up again after a
        # failed step (every block zeroed): whoever handed blocks out (the KV producer's
        # leases) must take them back and learn the worker's new epoch.
        self.kv_reset_listeners: list[Callable[[], None]] = []
        # Sleep mode (engine/worker_control.py): while asleep, requests are refused.
        self.sleep = SleepStatus()
        logger.info("KV cache: %d blocks of %d tokens (%d tokens)", num_blocks,
                    config.cache.block_size, num_blocks * config.cache.block_size)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request its caller has checked (`pagoda.request_checks.check_request`:
        the scheduler service and the offline `LLMEngine`, once each). EngineSleeping
        while the engine sleeps."""
        self.sleep.check_awake()
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)

    def step(self) -> list[EngineCoreOutput]:
        """schedule -> execute -> update (async scheduling: schedule the next step,
        submit it, then update from the oldest step in flight)."""
        self.last_scheduler_output = None
        if self.failure is not None:
            raise WorkerGroupFailed(str(self.failure))
        if self.async_scheduling and not self._suspects:
            return self._step_async()
        if self._in_flight:  # a failed step's suspects run one step at a time
            return self._drain_one()
        if not self.scheduler.has_unfinished_requests():
            return self.scheduler.take_pending_outputs()
        scheduler_output = self._schedule()
        self.last_scheduler_output = scheduler_output
        if self.scheduler.needs_worker(scheduler_output):  # tokens, or tier copies to run
            try:
                runner_output = self.executor.execute_model(scheduler_output)
            except StepRejected as exc:  # one request's fault: it fails, the rest go on
                reject_step(self.scheduler, scheduler_output, exc.request_id)
                self.rejected[exc.request_id] = str(exc)
                return self.scheduler.take_pending_outputs()
            except StepFailed as exc:  # failed midway: find the request at fault
                self._recover(scheduler_output, exc)
                return self.scheduler.take_pending_outputs()
            except WorkerGroupFailed as exc:  # final: the step's plan never ran
                self.failure = exc
                raise
            if self._suspects:
                step_quarantine.after_step(self.scheduler, scheduler_output)
        else:
            runner_output = ModelRunnerOutput.empty()
            self.scheduler.wait_for_grammars(GRAMMAR_WAIT_S)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_async(self) -> list[EngineCoreOutput]:
        """Plan and submit a step while the previous one runs; then wait for the oldest
        step in flight and apply its output. Returns without waiting only when the
        pipeline was empty (its first step), so that the next call plans the second."""
        scheduler = self.scheduler
        submitted = False
        if scheduler.has_unfinished_requests() and len(self._in_flight) < MAX_STEPS_IN_FLIGHT:
            plan = self._schedule()
            self.last_scheduler_output = plan
            if plan.total_num_scheduled_tokens:
                self._in_flight.append((plan, self.executor.submit_step(plan)))
                submitted = True
            else:  # never sent: the ids it would have told the worker to drop wait
                scheduler.unsend(plan)
                if not self._in_flight:  # nothing runs: as a synchronous step
                    scheduler.wait_for_grammars(GRAMMAR_WAIT_S)
                    return scheduler.update_from_output(plan, ModelRunnerOutput.empty())
        if not self._in_flight or (submitted and len(self._in_flight) == 1):
            return scheduler.take_pending_outputs()
        return self._drain_one()

    def _drain_one(self) -> list[EngineCoreOutput]:
        """Wait for the oldest step in flight and apply its output; when it failed, the
        steps behind it are waited for and dropped, and the engine recovers as from
        one failed step of all their requests."""
        plan, future = self._in_flight.popleft()
        try:
            runner_output = future.result()
        except (StepRejected, StepFailed) as exc:
            self._abandon_in_flight(plan)
            if isinstance(exc, StepRejected):
                self.scheduler.finish_requests([exc.request_id], FinishReason.ABORT)
                self.rejected[exc.request_id] = str(exc)
            self._recover(plan, StepFailed(str(exc)))
            return self.scheduler.take_pending_outputs()
        except WorkerGroupFailed as exc:
            self._abandon_in_flight(plan)
            self.failure = exc
            raise
        if self._suspects:
            step_quarantine.after_step(self.scheduler, plan)
        return self.scheduler.update_from_output(plan, runner_output)

    def _abandon_in_flight(self, failed: SchedulerOutput) -> None:
        """A step failed: wait for the steps behind it (whatever they return) and
        forget every token still expected; their requests recompute from what is known."""
        plans = [failed]
        while self._in_flight:
            plan, future = self._in_flight.popleft()
            concurrent.futures.wait([future])
            plans.append(plan)
        for plan in plans:
            self.scheduler.discard_plan(plan)
        for request in self.scheduler.requests.values():
            request.num_output_placeholders = 0

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def _schedule(self) -> SchedulerOutput:
        """The next plan; while a failed step's requests are suspects, one runs alone."""
        suspect = step_quarantine.next_suspect(self.scheduler) if self._suspects else None
        if suspect is None:
            self._suspects = False
            return self.scheduler.schedule()
        with step_quarantine.alone(self.scheduler, suspect):
            return self.scheduler.schedule()

    def _recover(self, plan: SchedulerOutput, exc: StepFailed) -> None:
        """A step failed midway (core/step_quarantine.py): recompute everything, set
        the worker's KV cache up again, and end the request found at fault, if any."""
        culprits = step_quarantine.recover(self.scheduler, plan)
        logger.error("step of %d requests failed midway (%s); %s", len(plan.num_scheduled_tokens),
                     exc, f"request(s) at fault: {', '.join(culprits)}" if culprits
                     else "its requests run alone until one is found at fault")
        for request_id in culprits:
            self.rejected[request_id] = f"the request failed a step ({exc})"
        self._suspects = True
        self.executor.initialize_kv_cache(self.scheduler.kv_cache_manager.pool.num_blocks)
        for listener in self.kv_reset_listeners:
            listener()

    def take_rejected(self) -> dict[str, str]:
        rejected, self.rejected = self.rejected, {}
        return rejected

    def take_invalid(self) -> dict[str, str]:
        """Requests a scheduler hook ended because of the request itself since the last
        call (id -> why: a constraint that failed to compile). The client's error; each
        also ends ABORT in the outputs."""
        return self.scheduler.take_failed()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def take_kv_events(self) -> list[KVEvent]:
        """The device's events (medium "GPU"), then the tiers' ("CPU", "DISK")."""
        manager = self.scheduler.kv_cache_manager
        events = manager.take_events()
        tiers = self.scheduler.kv_offload
        if tiers is not None:
            tier_events = tiers.take_events(manager.block_size)
            if manager.pool.enable_kv_events:
                events += tier_events
        return events

    def cached_block_hashes(self) -> list[bytes]:
        return self.scheduler.kv_cache_manager.pool.cached_hashes()

    def kv_index_snapshot(self) -> list[bytes]:
        """The device's cached hashes for a resync of the prefix index (which replaces
        every medium of this instance); the tiers' blocks follow as events."""
        if self.scheduler.kv_offload is not None:
            self.scheduler.kv_offload.republish()
        return self.cached_block_hashes()

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.kv_cache_manager.reset_prefix_cache()
        if reset and self.scheduler.kv_offload is not None:
            self.scheduler.kv_offload.clear()
        return reset

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()


def make_kv_offload_index(config: EngineConfig) -> KVOffloadIndex | None:
    """The scheduler's index of the host KV tier (--kv-offloading-size), None when off;
    the worker sizes its tier by the same rule (`host_kv_tier.host_tier_slots`)."""
    if config.cache.kv_offloading_size <= 0:
        return None
    # lazy: host_kv_tier brings torch, and a scheduler process builds its flags from this
    # module's imports without it (tests/services/cli/test_cli.py)
    from pagoda.core.kv_disk_index import KVDiskIndex
    from pagoda.worker.host_kv_tier import disk_tier_records, host_tier_slots

    num_slots, block_bytes = host_tier_slots(config)
    if num_slots <= 0:
        return None
    num_records = disk_tier_records(config)
    disk = KVDiskIndex(num_records) if num_records > 0 else None
    return KVOffloadIndex(num_slots, block_bytes, disk)


def make_structured_output_manager(config: EngineConfig) -> StructuredOutputManager:
    """The manager of this replica's grammars. The tokenizer it needs (for the backend's
    vocabulary tables) is loaded only when a constraint or a reasoning parser needs it."""

    def load_tokenizer():
        # lazy: transformers, loaded only when a grammar or a reasoning parser needs it
        from pagoda.tokenizer.loader import load_tokenizer as load

        return load(config.model, config.tokenizer)

    return StructuredOutputManager(config.structured_outputs, config.arch.vocab_size,
                                   load_tokenizer, config.arch.eos_token_ids)

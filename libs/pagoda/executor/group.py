"""The driver's side of a worker group: an `Executor` whose process is rank 0.

    scheduler step ──► driver = rank 0 ──broadcast (method, args)──► ranks 1..N-1
                           │  runs its own share                       run theirs
                           ◄──────── step result (from the output rank) ─┘

Each call (load, KV sizing, KV allocation, step) is broadcast on the control
group, typed by the method's annotations (never pickled: `rank_worker.broadcast_call`),
and then run by rank 0 itself; the collectives inside make the ranks meet.
The driver also carries the tokens the output rank sampled in one step to the
other ranks with the next plan (`parallel_runner.py`).

A failure is repaired, within bounds. When a collective fails (a peer died, so
its sockets closed) or a rank raises, the driver collects what the ranks recorded
and what the backend knows about dead ranks, stops every follower, drops its own
rank, and builds the group again: new follower ranks, a new store on a fresh
port (`GroupInit.generation` one more), weights loaded again. The new group holds
no KV cache and no request, so the failed step raises `StepFailed`, as one
rank's does (executor/in_process.py): the engine recomputes every request from
its tokens and calls `initialize_kv_cache`, which bumps the KV epoch for anyone
holding leases on the old blocks (EngineCore.kv_reset_listeners). A crash loop
(more rebuilds than `RestartBudget` allows) is final: `WorkerGroupFailed`,
naming the rank and its error, and every later call raises it at once. Nothing
waits on a dead rank: the failure shows within moments.

Backends (`ray_group.RayExecutor`, `multiproc.MultiprocExecutor`) only place,
start, watch and stop the follower ranks. The ranks themselves (`RankWorker`, the
collectives, the group's process groups) are `pagoda.distributed`'s, which knows
nothing of executors.
"""

from __future__ import annotations

import abc
import atexit
import gc
import json
import logging
import time
from typing import Callable

import torch

from pagoda.config import EngineConfig
from pagoda.distributed.process_group import (GroupInit, brief_error, create_master_store,
                                              is_peer_loss, joined_ranks, leave_group,
                                              recorded_errors)
from pagoda.worker.rank_worker import SHUTDOWN, RankWorker, broadcast_call
from pagoda.worker.worker_ops import callable_name
from pagoda.executor.base import Executor, InsufficientResources, StepFailed, WorkerGroupFailed
from pagoda.executor.restart_budget import RestartBudget
from pagoda.kv_transfer.block_shares import as_bytes, check_block_ids, runner_geometry
from pagoda.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)
# Calls that depend on nothing a failed group held: after a rebuild they simply run
# again. Any other call (a step, a KV transfer) raises StepFailed instead.
_STATELESS_CALLS = ("determine_num_blocks", "initialize_kv_cache", "reset")


class WorkerGroupExecutor(Executor, abc.ABC):
    """Rank 0 of a T x P group in this process; a backend runs ranks 1..N-1.

    Invariant: every rank sees the same calls in the same order. After a failure the
    group is rebuilt (holding no KV cache and no request) while `restarts` allows;
    else it is torn down and every call raises `WorkerGroupFailed`.
    """

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0,
                 collective_timeout_s: float = 600.0,
                 restarts: RestartBudget | None = None) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.restarts = restarts or RestartBudget()
        self.num_rebuilds = 0
        # Called after each rebuild (the gpu-worker counts them in its metrics).
        self.on_rebuild: Callable[[], None] = lambda: None
        self._startup_timeout_s = startup_timeout_s
        self._collective_timeout_s = collective_timeout_s
        self._device_type = torch.device(config.device).type
        self._failure: WorkerGroupFailed | None = None
        self._stopped = False
        self._sampled: dict[str, list[int]] = {}
        self._store = None
        self.weights_from_trainer = False  # set by update_weights (see _rebuild)
        self.worker: RankWorker | None = None
        try:
            self._place_group(self._device_type)
            self._start_group(generation=0)
        except BaseException as exc:
            failure = exc
            if isinstance(exc, Exception) and not isinstance(
                    exc, (WorkerGroupFailed, InsufficientResources)) and self._store is not None:
                failure = self._diagnose("start-up", exc)
            self._teardown()
            if failure is exc:
                raise
            raise failure from exc
        # A script that never calls shutdown still stops its ranks quietly at exit.
        atexit.register(self.shutdown)
        logger.info("worker group up: %d ranks (tensor_parallel_size=%d, "
                    "pipeline_parallel_size=%d) over %s", self.world_size,
                    config.tensor_parallel_size, config.pipeline_parallel_size, type(self).__name__)

    def _start_group(self, generation: int) -> None:
        """Start every rank of one life of the group and load its weights; raises
        WorkerGroupFailed (naming the rank) when a rank cannot start or load."""
        addr = self._master_addr()
        self._store = create_master_store(addr, self.world_size, self._startup_timeout_s)
        self.init = GroupInit(addr, self._store.port, self.config.tensor_parallel_size,
                              self.config.pipeline_parallel_size, self._device_type,
                              self._collective_timeout_s, generation)
        self._start_followers(self.init)
        self._wait_for_followers(self._startup_timeout_s)
        self.worker = RankWorker(self.config, 0, self.init, self._store,
                                 self._driver_device_index())
        try:
            self._call("load_model")
        except Exception as exc:
            raise self._diagnose("load_model", exc) from exc

    # ------------------------------------------------------------------ Executor
    def determine_num_blocks(self) -> int:
        return self._run("determine_num_blocks")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._run("initialize_kv_cache", num_blocks)
        self._sampled = {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        sampled, self._sampled = self._sampled, {}
        output = self._run("execute_model", scheduler_output, sampled)
        self._sampled = {req_id: tokens for req_id, tokens
                         in zip(output.req_ids, output.sampled_token_ids) if tokens}
        return output

    def reset(self) -> None:
        """Forget every request on every rank (as `ModelRunner.reset`)."""
        self._run("reset")
        self._sampled = {}

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """Every rank's result in rank order: rank 0's as returned, the others' as JSON
        brought them (lists for tuples and tensors). Arguments must be JSON values; a
        callable must be a module-level function (`worker_ops.callable_name`).
        RuntimeError naming the ranks when any rank raised (the group stays up)."""
        name = method if isinstance(method, str) else callable_name(method)
        payload = json.dumps({"args": list(args), "kwargs": kwargs or {}})
        if name == "update_weights":
            # From now on the checkpoint is not this group's weights: no rebuild (below).
            self.weights_from_trainer = True
        outcomes = self._run("collective_rpc", name, payload)
        errors = [f"rank {rank}: {o['error']}" for rank, o in enumerate(outcomes) if "error" in o]
        if errors:
            raise RuntimeError(f"collective_rpc({name!r}) failed on " + "; ".join(errors))
        return [o["ok"] for o in outcomes]

    def memory_report(self) -> list[dict[str, int]]:
        """Bytes of parameters and KV cache held by each rank, in rank order."""
        return self._run("memory_report")

    def kv_cache_geometry(self):
        worker = self.worker  # read once: a rebuild may drop it meanwhile (KV transfer thread)
        return None if worker is None else runner_geometry(worker.runner)

    def export_kv_blocks(self, block_ids: list[int]):
        """A collective call like a step: the caller serializes it with steps."""
        shape, _ = self._check_block_ids(block_ids)
        return shape.blocks(self._run("export_kv_blocks", list(block_ids)), len(block_ids))

    def import_kv_blocks(self, block_ids: list[int], blocks) -> None:
        """A collective call like a step: the caller serializes it with steps."""
        shape, _ = self._check_block_ids(block_ids)
        shape.check(blocks, len(block_ids))  # before any rank moves
        self.worker.kv_payload = as_bytes(blocks)
        self._run("import_kv_blocks", list(block_ids))

    def _check_block_ids(self, block_ids: list[int]):
        """Checked at the driver, before the call is broadcast: a bad id fails the
        transfer, never the group."""
        geometry = self.kv_cache_geometry()
        if geometry is None:
            raise ValueError("the KV cache is not allocated")
        check_block_ids(block_ids, geometry[1])
        return geometry

    def check_health(self) -> bool:
        """False once the group failed or a follower is gone."""
        return self._failure is None and not self._stopped and not self._dead_followers()

    def shutdown(self) -> None:
        if self._stopped:
            return
        if self._failure is None and self.worker is not None:
            try:
                broadcast_call(SHUTDOWN, (), self.worker.control)
            except Exception:  # noqa: BLE001 - stopping anyway
                logger.warning("could not tell the worker group to stop; killing it")
            else:
                self._teardown(graceful=True)
        self._teardown()

    # ------------------------------------------------------------------ driving
    def _call(self, method: str, *args):
        broadcast_call(method, args, self.worker.control)
        return getattr(self.worker, method)(*args)

    def _run(self, method: str, *args):
        """`method` on every rank. A failure rebuilds the group (or is final, see the
        module doc); then a call that holds no state is run again on the new group,
        and any other raises StepFailed: what it worked on (the KV cache, the
        requests' batch state) went with the old group."""
        while True:
            if self._failure is not None:
                raise WorkerGroupFailed(str(self._failure))
            if self.worker is None:
                raise WorkerGroupFailed("The worker group was shut down")
            try:
                return self._call(method, *args)
            except Exception as exc:  # noqa: BLE001 - a rank died or raised: diagnosed below
                failure = self._diagnose(method, exc)
                self._rebuild(failure, exc)
            if method not in _STATELESS_CALLS:
                raise StepFailed(f"{failure}; the group was rebuilt and holds no request: "
                                 "its KV cache must be initialized again")

    def _rebuild(self, failure: WorkerGroupFailed, exc: BaseException) -> None:
        """Stop the failed group and start a new one, waiting the budget's backoff
        first; a start-up that fails counts as a failure too. Raises the failure
        (final) once the budget is spent."""
        if self.weights_from_trainer:  # a rebuild would load the old checkpoint, silently
            self._failure = WorkerGroupFailed(
                f"{failure}. Not rebuilt: its weights came from update_weights, and a "
                "group rebuilt from the checkpoint would serve the old model")
            logger.error("%s", self._failure)
            self._teardown()
            raise self._failure from exc
        logger.error("%s; rebuilding the group", failure)
        while True:
            self._stop_group()
            delay = self.restarts.next_delay()
            if delay is None:
                self._failure = WorkerGroupFailed(
                    f"{failure}. Not rebuilt again: {self.restarts.describe()} already "
                    "(a crash loop); the replica stops")
                logger.error("%s", self._failure)
                self._teardown()
                raise self._failure from exc
            time.sleep(delay)
            generation = self.init.generation + 1
            try:
                self._start_group(generation)
            except Exception as start_exc:  # noqa: BLE001 - counted against the budget
                failure = (start_exc if isinstance(start_exc, WorkerGroupFailed)
                           else self._diagnose("rebuild", start_exc))
                logger.error("%s", failure)
                continue
            self._sampled = {}
            self.num_rebuilds += 1
            logger.warning("worker group rebuilt (generation %d, %d rebuilds so far)",
                           generation, self.num_rebuilds)
            self.on_rebuild()
            return

    def _wait_for_followers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        followers = set(range(1, self.world_size))
        while True:
            missing = followers - set(joined_ranks(self._store, self.world_size))
            if not missing:
                return
            if self._dead_followers():
                raise self._diagnose("start-up", None)
            if time.monotonic() > deadline:
                raise WorkerGroupFailed(f"Worker group ranks {sorted(missing)} did not start "
                                        f"within {timeout_s:g} s")
            time.sleep(0.05)

    def _diagnose(self, stage: str, exc: BaseException | None,
                  grace_s: float = 2.0) -> WorkerGroupFailed:
        """Name the ranks that failed and why. A peer's death shows up at the other
        ranks as a lost connection: those are reported as consequences, the dead or
        failing rank as the cause. Give the backend a moment to see the death."""
        def errors_now() -> dict[int, str]:
            return recorded_errors(self._store, self.world_size) if self._store else {}

        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not (self._dead_followers() or errors_now()):
            time.sleep(0.05)
        errors = errors_now()
        causes = {rank: reason for rank, reason in self._dead_followers().items()}
        causes.update({rank: brief_error(text) for rank, text in errors.items()})
        if exc is not None:
            causes[0] = brief_error(f"{type(exc).__name__}: {exc}")
        primary = {r: why for r, why in causes.items() if not is_peer_loss(why)} or causes
        message = "; ".join(f"rank {r}: {why}" for r, why in sorted(primary.items()))
        others = sorted(set(causes) - set(primary))
        if others:
            message += f" (then ranks {others} lost their connections)"
        return WorkerGroupFailed(f"The worker group of {self.world_size} ranks failed during "
                                 f"{stage}: {message}")

    def _stop_group(self, graceful: bool = False) -> None:
        """Stop this life of the group: every follower, rank 0's process groups and
        model (freed before a new one loads), the store and its port."""
        try:
            self._stop_followers(graceful)
        finally:
            if self.worker is not None:
                leave_group(self.worker.parallel, self.worker.control)
            self.worker = None
            self._store = None
            gc.collect()  # the old rank's weights and KV cache, before new ones load
            if self._device_type == "cuda":
                torch.cuda.empty_cache()

    def _teardown(self, graceful: bool = False) -> None:
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.shutdown)
        try:
            self._stop_group(graceful)
        finally:
            self._release_group()

    # ------------------------------------------------------------------ backend
    @abc.abstractmethod
    def _place_group(self, device_type: str) -> None:
        """Reserve one slot per rank, or raise a clear error when the cluster cannot."""

    @abc.abstractmethod
    def _master_addr(self) -> str:
        """An address of this host that every rank can reach."""

    @abc.abstractmethod
    def _start_followers(self, init: GroupInit) -> None:
        """Start ranks 1..N-1, each running `rank_worker.serve_follower`."""

    @abc.abstractmethod
    def _dead_followers(self) -> dict[int, str]:
        """rank -> how it ended, for each follower that is no longer running."""

    @abc.abstractmethod
    def _stop_followers(self, graceful: bool) -> None:
        """Stop every follower (they may already be gone) and forget them, keeping
        their slots for a rebuild; `graceful`: they were told to shut down, give them
        a moment to exit."""

    def _release_group(self) -> None:
        """Release the slots `_place_group` reserved (none by default)."""

    def _driver_device_index(self) -> int:
        return 0

"""The driver's side of a worker group: an `Executor` whose process is rank 0.

    scheduler step ──► driver = rank 0 ──broadcast (method, args)──► ranks 1..N-1
                           │  runs its own share                       run theirs
                           ◄──────── step result (from the output rank) ─┘

Each call (load, KV sizing, KV allocation, step) is broadcast on the control
group, typed by the method's annotations (never pickled: `rank_worker.broadcast_call`),
and then run by rank 0 itself; the collectives inside make the ranks meet.
The driver also carries the tokens the output rank sampled in one step to the
other ranks with the next plan (`parallel_runner.py`).

Failure is loud and final: if any collective fails (a peer died, so its sockets
closed) or a rank raises, the driver collects what the ranks recorded and what
the backend knows about dead ranks, tears the group down, and raises
`WorkerGroupFailed`; every later call raises it at once. Nothing waits on a dead
rank: the engine reports the error on its requests within moments.

Backends (`ray_group.RayExecutor`, `multiproc.MultiprocExecutor`) only place,
start, watch and stop the follower ranks. The ranks themselves (`RankWorker`, the
collectives, the group's process groups) are `pagoda.distributed`'s, which knows
nothing of executors.
"""

from __future__ import annotations

import abc
import atexit
import logging
import time

import torch

from pagoda.config import EngineConfig
from pagoda.distributed.process_group import (GroupInit, brief_error, create_master_store,
                                              is_peer_loss, joined_ranks, recorded_errors)
from pagoda.worker.rank_worker import SHUTDOWN, RankWorker, broadcast_call
from pagoda.executor.base import Executor, InsufficientResources, WorkerGroupFailed
from pagoda.kv_transfer.block_shares import as_bytes, check_block_ids, runner_geometry
from pagoda.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class WorkerGroupExecutor(Executor, abc.ABC):
    """Rank 0 of a T x P group in this process; a backend runs ranks 1..N-1.

    Invariant: every rank sees the same calls in the same order; after a failure the
    group is torn down and every call raises `WorkerGroupFailed`.
    """

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0,
                 collective_timeout_s: float = 600.0) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self._failure: WorkerGroupFailed | None = None
        self._stopped = False
        self._sampled: dict[str, list[int]] = {}
        self._store = None
        self.worker: RankWorker | None = None
        device_type = torch.device(config.device).type
        try:
            self._place_group(device_type)
            addr = self._master_addr()
            self._store = create_master_store(addr, self.world_size, startup_timeout_s)
            self.init = GroupInit(addr, self._store.port, config.tensor_parallel_size,
                                  config.pipeline_parallel_size, device_type, collective_timeout_s)
            self._start_followers(self.init)
            self._wait_for_followers(startup_timeout_s)
            self.worker = RankWorker(config, 0, self.init, self._store, self._driver_device_index())
            self._run("load_model")
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

    def memory_report(self) -> list[dict[str, int]]:
        """Bytes of parameters and KV cache held by each rank, in rank order."""
        return self._run("memory_report")

    def kv_cache_geometry(self):
        return None if self.worker is None else runner_geometry(self.worker.runner)

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
    def _run(self, method: str, *args):
        if self._failure is not None:
            raise WorkerGroupFailed(str(self._failure))
        if self.worker is None:
            raise WorkerGroupFailed("The worker group was shut down")
        try:
            broadcast_call(method, args, self.worker.control)
            return getattr(self.worker, method)(*args)
        except Exception as exc:
            self._failure = self._diagnose(method, exc)
            logger.error("%s", self._failure)
            self._teardown()
            raise self._failure from exc

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

    def _teardown(self, graceful: bool = False) -> None:
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.shutdown)
        try:
            self._stop_followers(graceful)
        finally:
            self.worker = None

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
        """Stop every follower (they may already be gone) and release their slots;
        `graceful`: they were told to shut down, give them a moment to exit."""

    def _driver_device_index(self) -> int:
        return 0

"""The interface the engine core drives, and the errors a worker group raises.

The engine core only sees `Executor`, so the same core drives an in-process model
runner (offline `LLM`), a gpu-worker service over gRPC (`GrpcWorkerExecutor`), or a
worker group of T x P ranks. This module imports nothing else of the package: every
executor depends on it, it depends on none of them.
"""

from __future__ import annotations

import abc

from pagoda.messages import ModelRunnerOutput, SchedulerOutput


class Executor(abc.ABC):
    """Invariant: `initialize_kv_cache` is called once, before any `execute_model`."""

    @abc.abstractmethod
    def determine_num_blocks(self) -> int:
        """How many KV blocks the worker group can hold."""

    @abc.abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every worker."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step."""

    def shutdown(self) -> None:
        """Release workers (no-op by default)."""

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """Run a worker method (`pagoda.worker.worker_ops`: a name, or a callable given
        the worker) on every rank; the results in rank order. Sleep mode and weight
        transfer go through it."""
        raise NotImplementedError(f"{type(self).__name__} cannot run worker methods")

    # KV transfer (prefill/decode disaggregation). Blocks travel as whole blocks, the
    # model's every layer and KV head (pagoda.kv_transfer.block_shares), whatever the
    # group's shape. An executor that cannot move blocks raises NotImplementedError.
    def kv_cache_geometry(self):
        """(BlockShape of one whole block, blocks in the cache), or None before the KV
        cache is allocated."""
        raise NotImplementedError(f"{type(self).__name__} cannot transfer KV blocks")

    def export_kv_blocks(self, block_ids: list[int]):
        """The whole blocks `block_ids` as one tensor [blocks, layers, 2, block_size,
        KV heads, head_dim] (BlockShape), on the cache's device for a single rank, on
        the CPU for a group. ValueError for an id outside the cache. The caller keeps
        the blocks from being written meanwhile (a lease)."""
        raise NotImplementedError(f"{type(self).__name__} cannot transfer KV blocks")

    def import_kv_blocks(self, block_ids: list[int], blocks) -> None:
        """Write whole blocks (as `export_kv_blocks` gives them, any device) into
        `block_ids`. ValueError, with nothing written, for an id outside the cache or
        blocks of another shape. The caller owns the target blocks (no running request
        reads them)."""
        raise NotImplementedError(f"{type(self).__name__} cannot transfer KV blocks")


class StepRejected(RuntimeError):
    """The worker refused a step before running any of it, because of one request
    (`request_id`): that request fails, the replica goes on (core/step_recovery.py)."""

    def __init__(self, message: str, request_id: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class StepFailed(RuntimeError):
    """The worker failed midway through a step (an exception while running it, not a
    refused plan): it dropped every request and waits for `initialize_kv_cache`; it is
    alive. The scheduler recovers (core/step_quarantine.py)."""


class WorkerGroupFailed(RuntimeError):
    """A rank of the worker group died or failed: the group can serve no more steps."""


class InsufficientResources(RuntimeError):
    """The cluster cannot place one slot (CPU share or GPU) per rank."""

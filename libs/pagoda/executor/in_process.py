"""`InProcessExecutor`: one rank, the model runner in the calling process."""

from __future__ import annotations

from pagoda.config import EngineConfig
import logging

from pagoda.executor.base import Executor, StepFailed
from pagoda.kv_transfer.block_shares import (check_block_ids, read_share, runner_geometry,
                                             runner_share, write_share)
from pagoda.messages import ModelRunnerOutput, SchedulerOutput
from pagoda.worker.model_runner import ModelRunner
from pagoda.worker.worker_ops import WorkerOps


class InProcessExecutor(Executor):
    """Invariant: `runner` holds the loaded model from construction on."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        self.runner.load_model()
        self.ops = WorkerOps(self.runner)

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        return [self.ops.call(method, args, kwargs)]

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """StepFailed (every request's batch state dropped) when the step raised."""
        try:
            return self.runner.execute_model(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - the batch state may be half-applied
            logging.getLogger(__name__).exception("step failed; forgetting every request")
            self.runner.reset()
            raise StepFailed(f"the step failed ({type(exc).__name__}: {exc})") from exc

    def kv_cache_geometry(self):
        return runner_geometry(self.runner)

    def export_kv_blocks(self, block_ids: list[int]):
        # One rank holds every layer and head: its share is the whole block.
        # Runs beside steps (the transport's thread): the blocks are leased.
        geometry = self._geometry()
        check_block_ids(block_ids, geometry[1])
        return read_share(self.runner.kv_caches, block_ids)

    def import_kv_blocks(self, block_ids: list[int], blocks) -> None:
        shape, num_blocks = self._geometry()
        check_block_ids(block_ids, num_blocks)
        shape.check(blocks, len(block_ids))
        write_share(self.runner.kv_caches, block_ids, blocks, runner_share(self.runner))

    def _geometry(self):
        geometry = runner_geometry(self.runner)
        if geometry is None:
            raise ValueError("the KV cache is not allocated")
        return geometry

    def reset(self) -> None:
        """Forget every request's batch state (a new scheduler knows none of them)."""
        self.runner.reset()

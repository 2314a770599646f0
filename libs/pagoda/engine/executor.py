"""Executors run a step's plan on the worker group and return its result.

The engine core only sees this interface, so the same core drives an in-process
model runner (offline `LLM`), a gpu-worker service over gRPC, or a Ray group.
`make_executor` picks the local one for a config: in-process for one rank, else a
worker group whose rank 0 is this process (`--distributed-executor-backend`).
"""

from __future__ import annotations

import abc

from pagoda.config import EngineConfig
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


class InProcessExecutor(Executor):
    """Runs the model runner in the calling process."""

    def __init__(self, config: EngineConfig) -> None:
        from pagoda.worker.model_runner import ModelRunner

        self.runner = ModelRunner(config)
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)


def make_executor(config: EngineConfig) -> Executor:
    """The executor that runs `config`'s worker group from this process."""
    if config.world_size == 1:
        return InProcessExecutor(config)
    if config.distributed_executor_backend == "ray":
        from pagoda.engine.ray_executor import RayExecutor

        return RayExecutor(config)
    from pagoda.engine.mp_executor import MultiprocExecutor

    return MultiprocExecutor(config)

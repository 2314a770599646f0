"""`InProcessExecutor`: one rank, the model runner in the calling process."""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.executor.base import Executor
from pagoda.messages import ModelRunnerOutput, SchedulerOutput
from pagoda.worker.model_runner import ModelRunner


class InProcessExecutor(Executor):
    """Invariant: `runner` holds the loaded model from construction on."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def reset(self) -> None:
        """Forget every request's batch state (a new scheduler knows none of them)."""
        self.runner.reset()

"""`EngineStatsRecorder`: one object the engine's driver loop feeds each step.

It keeps the per-request timestamps (`RequestStatsTracker`) and hands each
step's `SchedulerStats` and `IterationStats` to the Prometheus metrics and the
stats log line. The engine core itself knows nothing of either: the driver
(the scheduler service's engine thread, or an offline loop) calls `on_add`
after `EngineCore.add_request` and `on_step` after `EngineCore.step`.
"""

from __future__ import annotations

import time

from pagoda.core.scheduler import SchedulerStats
from pagoda.messages import EngineCoreOutput, EngineCoreRequest
from pagoda.metrics.engine_metrics import EngineMetrics
from pagoda.metrics.stat_logger import StatLogger
from pagoda.metrics.stats import IterationStats, RequestStatsTracker


class EngineStatsRecorder:
    """Call from the one thread that drives the engine core."""

    def __init__(self, metrics: EngineMetrics | None = None,
                 stat_logger: StatLogger | None = None) -> None:
        self.metrics = metrics
        self.stat_logger = stat_logger
        self.tracker = RequestStatsTracker()
        self.last_iteration: IterationStats | None = None

    def on_add(self, request: EngineCoreRequest, queued_ts: float | None = None) -> None:
        self.tracker.add_request(request, time.time() if queued_ts is None else queued_ts)

    def on_step(self, core, step_start: float, outputs: list[EngineCoreOutput],
                scheduler_stats: SchedulerStats | None = None) -> IterationStats:
        """`core`: the `EngineCore` that just stepped (its `last_scheduler_output`
        is this step's plan); `step_start`: `time.time()` before the step."""
        iteration = self.tracker.on_step(step_start, time.time(), core.last_scheduler_output,
                                         outputs)
        if scheduler_stats is None:
            scheduler_stats = core.get_stats()
        for sink in (self.metrics, self.stat_logger):
            if sink is not None:
                sink.record(scheduler_stats, iteration)
        self.last_iteration = iteration
        return iteration

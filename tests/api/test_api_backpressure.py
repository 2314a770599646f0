"""The scheduler's bounded waiting queue (--max-waiting-requests), without a model."""

from __future__ import annotations

import argparse
import threading
import time
from types import SimpleNamespace

from pagoda.core.scheduler import SchedulerStats
from pagoda.engine.arg_utils import EngineArgs
from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from pagoda.services.scheduler.engine_loop import EngineLoop, QueueFull


class QueueOnlyCore:
    """An engine core that queues requests and never schedules them."""

    def __init__(self, max_waiting: int | None) -> None:
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_waiting_requests=max_waiting))
        self.waiting: list[str] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        self.waiting.append(request.request_id)

    def abort_requests(self, request_ids) -> None:
        self.waiting = [r for r in self.waiting if r not in set(request_ids)]

    def step(self):
        return []

    def has_unfinished_requests(self) -> bool:
        return False

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(0, len(self.waiting), 0.0, 0, 0, 0, 8, 8)

    def take_kv_events(self):
        return []


def submit(loop: EngineLoop, rid: str) -> SimpleNamespace:
    """Submit a request; the result records its on_accept call."""
    result = SimpleNamespace(done=threading.Event(), error=None)

    def on_accept(error):
        result.error = error
        result.done.set()

    loop.submit(EngineCoreRequest(rid, [1, 2], SamplingParams(max_tokens=2)), on_accept)
    return result


def outcome(result: SimpleNamespace, timeout: float = 5.0):
    assert result.done.wait(timeout), "on_accept was never called"
    return result.error


def make_loop(core) -> EngineLoop:
    return EngineLoop(core, lambda outs: None, lambda events: None, lambda exc: None)


def test_beyond_the_bound_submits_are_refused_at_once():
    core = QueueOnlyCore(max_waiting=2)
    loop = make_loop(core)
    first, second, third = (submit(loop, f"r{i}") for i in range(3))
    assert isinstance(outcome(third, 0), QueueFull)  # refused before the loop even runs
    assert "2 requests" in str(outcome(third, 0))
    loop.start()
    try:
        assert outcome(first) is None and outcome(second) is None
        assert isinstance(outcome(submit(loop, "r3")), QueueFull)
        loop.abort(["r0"])  # a waiting request leaves: room for one more
        deadline = time.monotonic() + 5
        while True:
            late = submit(loop, "r4")
            if outcome(late) is None or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert outcome(late) is None and core.waiting == ["r1", "r4"]
    finally:
        loop.stop()


def test_unbounded_by_default():
    loop = make_loop(QueueOnlyCore(max_waiting=None))
    results = [submit(loop, f"r{i}") for i in range(50)]
    loop.start()
    try:
        assert all(outcome(r) is None for r in results)
    finally:
        loop.stop()


def test_max_waiting_requests_is_an_engine_flag():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--max-waiting-requests", "3"]))
    assert args.max_waiting_requests == 3
    assert EngineArgs.from_cli_args(parser.parse_args([])).max_waiting_requests is None

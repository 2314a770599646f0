"""A request that reaches a sleeping engine (it raced the servicer's own check) is
refused with EngineSleeping through its `on_accept`, and the engine loop goes on: it
still runs calls and accepts requests once the engine is awake."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from pagoda.engine.worker_control import EngineSleeping, SleepStatus
from pagoda.services.scheduler.engine_loop import EngineLoop


class SleepyCore:
    def __init__(self) -> None:
        self.sleep = SleepStatus(level=1, asleep={"weights", "kv_cache"})
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_waiting_requests=None))
        self.added: list = []

    def get_stats(self):
        return SimpleNamespace(num_waiting=0, num_running=0)

    def add_request(self, request) -> None:
        self.sleep.check_awake()
        self.added.append(request)

    def has_unfinished_requests(self) -> bool:
        return False

    def abort_requests(self, ids) -> None:
        pass

    def step(self) -> list:
        return []

    def take_kv_events(self) -> list:
        return []


def submit(loop: EngineLoop, request) -> object:
    answered = threading.Event()
    result: list = []
    loop.submit(request, lambda error: (result.append(error), answered.set()))
    assert answered.wait(10)
    return result[0]


def test_a_request_to_a_sleeping_engine_is_refused_and_the_loop_lives_on():
    core = SleepyCore()
    failures: list = []
    loop = EngineLoop(core, lambda outputs: None, lambda events: None, failures.append)
    loop.start()
    try:
        error = submit(loop, SimpleNamespace(request_id="r0"))
        assert isinstance(error, EngineSleeping) and "sleeping" in str(error)
        woke = threading.Event()
        loop.call_soon(lambda: (core.sleep.asleep.clear(), woke.set()))
        assert woke.wait(10)
        assert submit(loop, SimpleNamespace(request_id="r1")) is None
        assert [r.request_id for r in core.added] == ["r1"]
        assert failures == [] and loop.failure is None
    finally:
        loop.stop()

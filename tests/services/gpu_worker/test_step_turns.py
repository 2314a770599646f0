"""Async scheduling sends step N+1 while N runs; the worker holds N+1 until N is
queued, then runs it at once. The step sent ahead must be woken when its turn comes:
before the fix it slept out the turn's poll (0.5 s) whenever it reached the worker
before N, which at c=1 on a GPU cost up to half a second per token."""

from __future__ import annotations

import threading

from pagoda.messages import ModelRunnerOutput, SchedulerOutput
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as wpb
from pagoda.services.common.protocol.worker import scheduler_output_to_proto
from pagoda.services.gpu_worker.servicer import WorkerServicer


class Runner:
    def __init__(self) -> None:
        self.steps = 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def execute_model(self, plan) -> ModelRunnerOutput:
        self.steps += 1
        return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


class Context:
    def is_active(self) -> bool:
        return True

    def abort(self, code, details):
        raise AssertionError(f"refused: {code} {details}")


def step(worker: WorkerServicer, step_id: int):
    request = wpb.ExecuteModelRequest(
        step_id=step_id, scheduler_output=scheduler_output_to_proto(SchedulerOutput.empty()))
    return worker.ExecuteModel(request, Context())


def test_a_step_sent_ahead_runs_as_soon_as_the_one_before_is_queued(monkeypatch):
    # The poll is only a safety net: made long here, so a missed wake-up hangs the step
    # (and fails the join below) instead of hiding behind the poll.
    monkeypatch.setattr(WorkerServicer, "TURN_POLL_S", 60.0)
    runner = Runner()
    worker = WorkerServicer(runner, "m", "float32", "cpu")
    worker.InitializeKvCache(wpb.InitializeKvCacheRequest(num_blocks=4), Context())
    ahead_done = threading.Event()

    def send_ahead():
        step(worker, 1)
        ahead_done.set()

    ahead = threading.Thread(target=send_ahead, daemon=True)
    ahead.start()
    # Step 1 waits for its turn (nothing ran yet); step 0 arrives second.
    assert not ahead_done.wait(0.2)
    assert runner.steps == 0
    step(worker, 0)
    assert ahead_done.wait(10.0), "the step sent ahead was not woken when its turn came"
    assert runner.steps == 2

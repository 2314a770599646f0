"""`WorkerGroupExecutor` (through the mp backend): a group that cannot be (re)built
fails loudly: within seconds, naming the rank, never a hang. (A rank that dies once
is survived: test_group_rebuild.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from group_cases import engine_kwargs

from pagoda import LLM, SamplingParams
from pagoda.executor.base import WorkerGroupFailed

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def generate_in_background(llm: LLM) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def body() -> None:
        try:
            outputs = llm.generate([[5, 6, 7, 8]] * 4, LONG, use_tqdm=False)
            result["tokens"] = [o.outputs[0].token_ids for o in outputs]
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            result["error"] = exc
            result["at"] = time.monotonic()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, result


def kill_during_generation(llm: LLM, kill) -> tuple[dict, float]:
    """Start a long generation, kill a rank once steps are flowing; (result, killed at)."""
    core = llm.llm_engine.core
    thread, result = generate_in_background(llm)
    deadline = time.monotonic() + 30
    while core.get_stats().num_running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # well inside the generation
    killed_at = time.monotonic()
    kill()
    thread.join(120)
    assert not thread.is_alive(), "generation hung after a rank died"
    return result, killed_at


def test_a_follower_that_dies_during_a_rebuild_fails_the_rebuild_too(tiny_llama_dir):
    """A follower that dies while the group is idle is found at the next step: the
    group is rebuilt; when every rebuild dies as well, the generation fails within
    seconds of the budget's end (never a hang), naming the rank."""
    from pagoda.executor.restart_budget import RestartBudget
    from pagoda.executor.multiproc import MultiprocExecutor

    llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="mp",
              **engine_kwargs())
    executor = llm.llm_engine.core.executor
    executor.restarts = RestartBudget(max_restarts=1, backoff_s=0.1)
    original = MultiprocExecutor._start_followers

    def start_and_kill(self, init):
        original(self, init)
        self.processes[1].kill()

    try:
        os.kill(executor.processes[1].pid, signal.SIGKILL)
        executor.processes[1].wait(10)
        executor._start_followers = start_and_kill.__get__(executor)
        start = time.monotonic()
        with pytest.raises(WorkerGroupFailed, match=r"rank 1: process exited with code -9.*"
                                                    r"crash loop"):
            llm.generate([[1, 2, 3]], LONG, use_tqdm=False)
        assert time.monotonic() - start < 30
        assert not executor.check_health()
    finally:
        llm.llm_engine.core.shutdown()


def test_a_follower_that_cannot_start_is_reported(tiny_llama_dir, monkeypatch):
    """A follower whose start-up fails (here: it is handed a model path that does not
    exist) fails the group's construction with that rank's own error, not a timeout."""
    import dataclasses

    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.executor.multiproc import MultiprocExecutor

    config = EngineArgs(model=tiny_llama_dir, tensor_parallel_size=2,
                        distributed_executor_backend="mp", dtype="float32").create_engine_config()
    original = MultiprocExecutor._start_followers

    def start_with_a_broken_config(self, init):
        good, self.config = self.config, dataclasses.replace(self.config, model="/nonexistent")
        try:
            original(self, init)
        finally:
            self.config = good

    monkeypatch.setattr(MultiprocExecutor, "_start_followers", start_with_a_broken_config)
    start = time.monotonic()
    with pytest.raises(WorkerGroupFailed,
                       match=r"during load_model: rank 1: FileNotFoundError: .*/nonexistent"):
        MultiprocExecutor(config)
    assert time.monotonic() - start < 30

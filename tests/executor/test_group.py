"""`WorkerGroupExecutor` (through the mp backend): a rank that dies fails its group
loudly: the step raises within seconds, naming the rank, and every later call fails
at once (never a hang)."""

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
            llm.generate([[5, 6, 7, 8]] * 4, LONG, use_tqdm=False)
            result["finished"] = True
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
    thread.join(30)
    assert not thread.is_alive(), "generation hung after a rank died"
    return result, killed_at


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_killed_follower_process_fails_the_generation_within_seconds(tiny_llama_dir, tp, pp):
    llm = LLM(model=tiny_llama_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              distributed_executor_backend="mp", **engine_kwargs())
    executor = llm.llm_engine.core.executor
    try:
        result, killed_at = kill_during_generation(
            llm, lambda: os.kill(executor.processes[1].pid, signal.SIGKILL))
        assert "finished" not in result
        error = result["error"]
        assert isinstance(error, WorkerGroupFailed)
        assert "rank 1: process exited with code -9" in str(error)
        assert result["at"] - killed_at < 10
        # The group is gone for good: the next call fails at once, and says why.
        start = time.monotonic()
        with pytest.raises(WorkerGroupFailed, match="rank 1"):
            llm.generate([[1, 2, 3]], LONG, use_tqdm=False)
        assert time.monotonic() - start < 1
        assert not executor.check_health()
        assert executor.processes[1].poll() is not None
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

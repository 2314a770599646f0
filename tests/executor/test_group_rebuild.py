"""A worker group whose rank dies or raises mid-generation is rebuilt, and the replica
serves on: every request finishes with the greedy tokens of an undisturbed run (its
KV is lost with the old group, so it is recomputed from its tokens), a request after
it works, and KV leases on the old blocks are invalidated. A rank that fails in every
life of the group (a crash loop) ends the replica, naming the rank and its error."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from group_cases import GREEDY_PROMPTS, engine_kwargs, greedy_params

from pagoda import LLM
from pagoda.executor.base import WorkerGroupFailed
from pagoda.executor.restart_budget import RestartBudget
from pagoda.fault_injection import ENV

pytestmark = pytest.mark.extended  # make test-extended


def group_llm(model: str, tp: int = 2, pp: int = 1) -> LLM:
    return LLM(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
               distributed_executor_backend="mp", **engine_kwargs())


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def kill_follower_before_step(executor, rank: int, step: int) -> dict:
    """SIGKILL follower `rank` just before the executor's `step`-th step (1-based),
    mid-generation, and wait until it is dead; the returned dict gets its pid."""
    run_step, killed = executor.execute_model, {}

    def step_then_maybe_kill(scheduler_output):
        killed["steps"] = killed.get("steps", 0) + 1
        if killed["steps"] == step:
            process = executor.processes[rank]
            killed["pid"] = process.pid
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)
        return run_step(scheduler_output)

    executor.execute_model = step_then_maybe_kill
    return killed


def finishes_like_an_undisturbed_run(llm: LLM, reference) -> list[str]:
    """Generate GREEDY_PROMPTS and a request after them; the KV resets seen meanwhile."""
    core = llm.llm_engine.core
    resets: list[str] = []
    core.kv_reset_listeners.append(lambda: resets.append("reset"))
    outputs = llm.generate(GREEDY_PROMPTS, greedy_params(), use_tqdm=False)
    assert token_ids(outputs) == reference.token_ids
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(outputs)
    # The replica serves on, and nothing stays held.
    after = llm.generate(GREEDY_PROMPTS[:2], greedy_params(), use_tqdm=False)
    assert token_ids(after) == reference.token_ids[:2]
    assert core.get_stats().kv_cache_usage == 0.0
    return resets


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_killed_follower_is_replaced_and_greedy_answers_stay(tiny_llama_dir, reference,
                                                                tp, pp):
    llm = group_llm(tiny_llama_dir, tp, pp)
    executor = llm.llm_engine.core.executor
    old_port = executor.init.master_port
    try:
        killed = kill_follower_before_step(executor, 1, step=4)
        resets = finishes_like_an_undisturbed_run(llm, reference)
        assert "pid" in killed  # it died mid-generation
        assert executor.num_rebuilds == 1
        assert resets == ["reset"]  # KV epoch bumped once: leases on old blocks refused
        assert executor.processes[1].pid != killed["pid"]
        assert executor.init.generation == 1 and executor.init.master_port != old_port
        assert executor.check_health()
    finally:
        llm.llm_engine.core.shutdown()


def test_an_exception_on_one_rank_is_survived(tiny_llama_dir, reference, monkeypatch, caplog):
    # Rank 1's 3rd step, once: in the group's first life only (followers read the
    # variable as they start; the driver's rank 0 never matches).
    monkeypatch.setenv(ENV, json.dumps([{"point": "rank.step", "rank": 1, "generation": 0,
                                         "after": 2}]))
    llm = group_llm(tiny_llama_dir)
    executor = llm.llm_engine.core.executor
    try:
        resets = finishes_like_an_undisturbed_run(llm, reference)
        assert executor.num_rebuilds == 1 and resets == ["reset"]
        assert re.search(r"failed during execute_model: rank 1: \S*InjectedFault: injected "
                         r"fault in rank 1's step 3", caplog.text)
    finally:
        llm.llm_engine.core.shutdown()


def test_a_crash_loop_ends_the_replica_naming_the_rank(tiny_llama_dir, monkeypatch):
    # Rank 1's first step in every life of the group (no generation key, no end).
    monkeypatch.setenv(ENV, json.dumps([{"point": "rank.step", "rank": 1, "times": 0}]))
    llm = group_llm(tiny_llama_dir)
    executor = llm.llm_engine.core.executor
    executor.restarts = RestartBudget(max_restarts=2, backoff_s=0.1)
    try:
        with pytest.raises(WorkerGroupFailed) as failed:
            llm.generate(GREEDY_PROMPTS[:3], greedy_params(), use_tqdm=False)
        message = str(failed.value)
        assert re.search(r"failed during execute_model: rank 1: \S*InjectedFault: injected "
                         r"fault in rank 1's step 1", message)
        assert "Not rebuilt again: 2 rebuilds within 300 s already (a crash loop)" in message
        assert executor.num_rebuilds == 2
        # Final: the next call fails at once, with the same reason; no rank is left.
        start = time.monotonic()
        with pytest.raises(WorkerGroupFailed, match="crash loop"):
            llm.generate([[1, 2, 3]], greedy_params(), use_tqdm=False)
        assert time.monotonic() - start < 1
        assert not executor.check_health() and executor.processes == {}
    finally:
        llm.llm_engine.core.shutdown()

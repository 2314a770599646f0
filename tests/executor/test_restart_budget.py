"""`RestartBudget`: a group may be rebuilt `max_restarts` times within a window, each
time after a longer wait; failures further apart than the window never add up."""

from __future__ import annotations

import pytest

from pagoda.executor.restart_budget import RestartBudget
from pagoda.worker.fault_injection import StepFault, from_env


def test_backoff_doubles_until_the_budget_is_spent():
    now = [0.0]
    budget = RestartBudget(max_restarts=3, window_s=60, backoff_s=1, max_backoff_s=3,
                           clock=lambda: now[0])
    assert [budget.next_delay() for _ in range(4)] == [1, 2, 3, None]
    now[0] = 61.0  # the old rebuilds left the window: a new failure is rebuilt at once
    assert budget.next_delay() == 1


def test_fault_injection_is_inert_unless_asked(monkeypatch):
    monkeypatch.delenv("PAGODA_FAULT_INJECTION", raising=False)
    assert from_env() is None
    monkeypatch.setenv("PAGODA_FAULT_INJECTION", "rank=1,step=2")
    fault = from_env()
    assert fault == StepFault(rank=1, step=2, generation=0)
    fault.before_step(0, 0)  # another rank: never
    fault.before_step(1, 0)
    with pytest.raises(RuntimeError, match="rank 1's step 2"):
        fault.before_step(1, 0)
    fault.before_step(1, 0)  # once
    monkeypatch.setenv("PAGODA_FAULT_INJECTION", "rank=1,stpe=2")
    with pytest.raises(ValueError, match="unknown fields"):
        from_env()

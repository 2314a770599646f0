"""`RestartBudget`: a group may be rebuilt `max_restarts` times within a window, each
time after a longer wait; failures further apart than the window never add up."""

from __future__ import annotations

from pagoda.executor.restart_budget import RestartBudget


def test_backoff_doubles_until_the_budget_is_spent():
    now = [0.0]
    budget = RestartBudget(max_restarts=3, window_s=60, backoff_s=1, max_backoff_s=3,
                           clock=lambda: now[0])
    assert [budget.next_delay() for _ in range(4)] == [1, 2, 3, None]
    now[0] = 61.0  # the old rebuilds left the window: a new failure is rebuilt at once
    assert budget.next_delay() == 1


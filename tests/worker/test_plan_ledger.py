"""`PlanLedger` on decode diffs (the check's inlined per-request path): every refusal
names its request, and a plan that fits is accepted and recorded."""

from __future__ import annotations

import pytest

from pagoda.messages import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from pagoda.worker.plan_checks import PlanLedger, PlanRejected, _Held


def _ledger() -> PlanLedger:
    ledger = PlanLedger(num_blocks=8, block_size=4, vocab_size=100, max_model_len=64)
    ledger.held["a"] = _Held(num_tokens=4, num_blocks=1, num_computed_tokens=3)
    ledger.held["b"] = _Held(num_tokens=4, num_blocks=1, num_computed_tokens=3)
    return ledger


def _decode(rows: list[tuple[str, list[int], int, int]], **kw) -> SchedulerOutput:
    """rows: (request, new blocks, computed tokens, scheduled tokens)."""
    return SchedulerOutput([], CachedRequestData([r[0] for r in rows], [r[1] for r in rows],
                                                 [r[2] for r in rows]),
                           {r[0]: r[3] for r in rows}, sum(r[3] for r in rows), **kw)


def test_a_fitting_decode_step_is_accepted_and_recorded():
    ledger = _ledger()
    plan = _decode([("a", [], 3, 1), ("b", [1], 3, 1)])
    ledger.check(plan)
    ledger.record(plan, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[7], [8]]))
    assert ledger.held["a"] == _Held(5, 1, 4)
    assert ledger.held["b"] == _Held(5, 2, 4)
    # The next decode of "a" needs a second block: without it the plan is refused.
    with pytest.raises(PlanRejected, match="do not fit its 1 blocks") as info:
        ledger.check(_decode([("a", [], 4, 1)]))
    assert info.value.request_id == "a"
    ledger.check(_decode([("a", [2], 4, 1), ("b", [], 4, 1)]))


@pytest.mark.parametrize("plan, culprit, message", [
    (_decode([("a", [], 3, 1), ("b", [], 3, 2)]), "b", "are not among its 4"),
    (_decode([("a", [], 3, 0)]), "a", "are not among its 4"),
    (_decode([("b", [], -1, 1)]), "b", "are not among its 4"),
    (_decode([("a", [8], 3, 1)]), "a", "outside the cache"),
    (_decode([("a", [], 3, 1)], finished_req_ids={"a"}), "a", "does not hold"),
    (_decode([("ghost", [], 0, 1)]), "ghost", "does not hold"),
])
def test_a_decode_diff_that_does_not_fit_is_refused_naming_its_request(plan, culprit, message):
    ledger = _ledger()
    with pytest.raises(PlanRejected, match=message) as info:
        ledger.check(plan)
    assert info.value.request_id == culprit

"""How a pipeline step is cut into micro-batches."""

from __future__ import annotations

import itertools

import pytest

from pagoda.worker.parallel_runner import split_micro_batches


@pytest.mark.parametrize("sizes,max_batches", [
    ([1] * 8, 2), ([1] * 8, 4), ([64, 1, 1, 1], 2), ([1, 1, 1, 64], 2), ([5], 4),
    ([3, 3], 4), ([10, 20, 30, 40, 50], 3),
])
def test_micro_batches_keep_plan_order_and_cover_every_request(sizes, max_batches):
    plan = {f"r{i}": n for i, n in enumerate(sizes)}
    batches = split_micro_batches(plan, max_batches)
    assert len(batches) == min(max_batches, len(sizes))
    assert all(batches)  # none empty
    assert list(itertools.chain.from_iterable(b.items() for b in batches)) == list(plan.items())


def test_equal_requests_split_evenly():
    batches = split_micro_batches({f"r{i}": 1 for i in range(8)}, 2)
    assert [len(b) for b in batches] == [4, 4]
    batches = split_micro_batches({"a": 30, "b": 10, "c": 10, "d": 10}, 2)
    assert [list(b) for b in batches] == [["a"], ["b", "c", "d"]]

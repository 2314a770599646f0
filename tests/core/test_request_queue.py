"""The waiting queue's two orders (`pagoda.core.request_queue`)."""

import pytest

from pagoda.core.request import Request
from pagoda.core.request_queue import (FCFSRequestQueue, PriorityRequestQueue, SchedulingPolicy,
                                       create_request_queue)
from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams


def req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    core = EngineCoreRequest(rid, [1, 2, 3], SamplingParams(), arrival_time=arrival,
                             priority=priority)
    return Request(core, block_size=4, hash_seed="s", max_model_len=64)


def drain(queue) -> list[str]:
    out = []
    while queue:
        out.append(queue.pop_request().request_id)
    return out


def test_priority_queue_pops_lowest_value_then_earliest_arrival():
    q = PriorityRequestQueue()
    for r in [req("late-high", 5, 1.0), req("b", 1, 3.0), req("a", 1, 2.0),
              req("neg", -2, 9.0), req("early-high", 5, 0.5)]:
        q.add_request(r)
    assert q.peek_request().request_id == "neg"
    assert [r.request_id for r in q] == ["neg", "a", "b", "early-high", "late-high"]
    assert drain(q) == ["neg", "a", "b", "early-high", "late-high"]


def test_exact_ties_keep_insertion_order():
    q = PriorityRequestQueue()
    for rid in "xyz":
        q.add_request(req(rid, 3, 1.0))
    assert drain(q) == ["x", "y", "z"]


def test_fcfs_prepend_goes_to_the_front_but_priority_prepend_goes_to_its_rank():
    fcfs, prio = FCFSRequestQueue(), PriorityRequestQueue()
    first, second, resumed = req("first", 0, 1.0), req("second", 0, 2.0), req("resumed", 9, 3.0)
    for q in (fcfs, prio):
        q.add_request(first)
        q.add_request(second)
        q.prepend_requests([resumed])
    assert drain(fcfs) == ["resumed", "first", "second"]
    assert drain(prio) == ["first", "second", "resumed"]


def test_removed_requests_are_never_popped_and_the_length_follows():
    q = PriorityRequestQueue()
    a, b, c = req("a", 0, 1.0), req("b", 1, 1.0), req("c", 2, 1.0)
    for r in (a, b, c):
        q.add_request(r)
    q.remove_request(a)
    q.remove_request(c)
    assert len(q) == 1 and [r.request_id for r in q] == ["b"]
    assert q.peek_request() is b
    with pytest.raises(ValueError):
        q.remove_request(a)
    q.add_request(a)  # a removed request may come back (a new entry, not the dead one)
    assert drain(q) == ["a", "b"]
    with pytest.raises(IndexError):
        q.pop_request()


def test_a_request_is_queued_at_most_once():
    q = PriorityRequestQueue()
    r = req("a")
    q.add_request(r)
    with pytest.raises(ValueError):
        q.add_request(r)


def test_factory_by_policy_name():
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue(SchedulingPolicy.PRIORITY), PriorityRequestQueue)
    with pytest.raises(ValueError):
        create_request_queue("lifo")

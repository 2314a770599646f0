"""Priority scheduling (`--scheduling-policy priority`) with a scripted model."""

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.scheduler import Scheduler
from pagoda.messages import EngineCoreRequest, ModelRunnerOutput
from pagoda.sampling_params import SamplingParams


def make_scheduler(policy, num_blocks=64, max_seqs=8, block_size=4):
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64,
                                     max_model_len=256, policy=policy),
                     CacheConfig(block_size=block_size, enable_prefix_caching=False), num_blocks)


def add(s, rid, n_prompt, priority=0, arrival=0.0, max_tokens=8):
    s.add_request(EngineCoreRequest(rid, list(range(1, n_prompt + 1)),
                                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), [0],
                                    arrival_time=arrival, priority=priority))


def step(s, token=7):
    so = s.schedule()
    req_ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        req = s.requests[rid]
        req_ids.append(rid)
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    return so, s.update_from_output(so, ModelRunnerOutput(req_ids, sampled))


def admission_order(s) -> list[str]:
    """Run to the end one request at a time (max_num_seqs=1): the order they started."""
    order = []
    while s.has_unfinished_requests():
        so, _ = step(s)
        order += [r.req_id for r in so.scheduled_new_reqs]
    return order


def test_lower_priority_value_is_admitted_first_ties_by_arrival():
    s = make_scheduler("priority", max_seqs=1)
    add(s, "p5", 4, priority=5, arrival=1.0)
    add(s, "p1-late", 4, priority=1, arrival=3.0)
    add(s, "p1-early", 4, priority=1, arrival=2.0)
    add(s, "p-neg", 4, priority=-1, arrival=4.0)
    assert admission_order(s) == ["p-neg", "p1-early", "p1-late", "p5"]


def test_fcfs_ignores_priority_values_and_keeps_arrival_order():
    s = make_scheduler("fcfs", max_seqs=1)
    for rid in ["c", "a", "b"]:
        add(s, rid, 4)
    assert admission_order(s) == ["c", "a", "b"]


def test_a_later_high_priority_request_overtakes_the_waiting_queue():
    s = make_scheduler("priority", max_seqs=1)
    add(s, "running", 4, priority=3, arrival=0.0, max_tokens=3)
    step(s)  # admitted alone
    add(s, "low", 4, priority=3, arrival=1.0)
    add(s, "urgent", 4, priority=0, arrival=2.0)
    assert admission_order(s) == ["urgent", "low"]


def memory_pressure(policy: str, priority_a: int, priority_b: int):
    """5 blocks of 4 tokens. `a` (7-token prompt) runs first, then `b` (8 tokens) joins;
    in the third step `a` takes the last free block for its 9th token and `b` needs
    one more: someone is preempted after `a` was already planned."""
    s = make_scheduler(policy, num_blocks=5)
    add(s, "a", 7, priority=priority_a, arrival=1.0)
    step(s)
    add(s, "b", 8, priority=priority_b, arrival=2.0)
    step(s)
    so, _ = step(s)
    return s, so


def test_priority_preempts_the_highest_value_even_if_it_was_planned_first():
    s, so = memory_pressure("priority", priority_a=9, priority_b=0)
    assert so.preempted_req_ids == {"a"}
    # a's planned token went back: the plan holds b only, in every column.
    assert so.num_scheduled_tokens == {"b": 1} and so.total_num_scheduled_tokens == 1
    assert so.scheduled_cached_reqs.req_ids == ["b"]
    assert len(so.scheduled_cached_reqs.new_block_ids) == 1
    assert len(so.scheduled_cached_reqs.num_computed_tokens) == 1
    assert [r.request_id for r in s.waiting] == ["a"] and s.requests["a"].num_computed_tokens == 0
    assert s.kv_cache_manager.pool.num_free_blocks == 5 - 3  # b: 3 blocks for 9 tokens
    while s.has_unfinished_requests():  # a resumes (recomputed) and both finish
        step(s)
    assert s.kv_cache_manager.pool.num_free_blocks == 5


def test_equal_priorities_preempt_the_latest_arrival():
    _, so = memory_pressure("priority", priority_a=0, priority_b=0)
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}


def test_fcfs_preempts_the_latest_admitted():
    _, so = memory_pressure("fcfs", priority_a=0, priority_b=0)
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}

"""The scheduler's side of asynchronous onloads, with a scripted worker (no model): the
request waits out of the batch holding its blocks, comes back with the loaded part
computed, and never leaves the queue waiting on itself."""

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.kv_offload import KVOffloadIndex
from pagoda.core.request import RequestStatus
from pagoda.core.scheduler import Scheduler
from pagoda.messages import EngineCoreRequest, ModelRunnerOutput
from pagoda.sampling_params import SamplingParams

BS = 4


def _scheduler(num_blocks: int, policy: str = "fcfs") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                     max_model_len=256, policy=policy),
                     CacheConfig(block_size=BS, enable_prefix_caching=True), num_blocks,
                     kv_offload=KVOffloadIndex(32, 100))


def _add(s, rid, prompt, max_tokens=1, priority=0):
    s.add_request(EngineCoreRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens),
                                    [0], priority=priority))


def _step(s, finished_recving=(), invalid=()):
    """One step; every request that reached its known tokens samples token 7."""
    plan = s.schedule()
    ids = list(plan.num_scheduled_tokens)
    sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else []
               for r in ids]
    s.update_from_output(plan, ModelRunnerOutput(ids, sampled,
                                                 finished_recving=set(finished_recving),
                                                 invalid_block_ids=set(invalid)))
    return plan


def _run(s):
    """Until every request ended, the worker finishing each onload a step after it began."""
    while s.running or s.waiting or s.onloading:
        _step(s, finished_recving=set(s.onloading))


PREFIX = list(range(100, 116))  # 4 blocks


def _evicted_prefix(num_blocks: int, policy: str = "fcfs") -> Scheduler:
    """A scheduler whose device pool lost PREFIX's 4 blocks to the host tier."""
    s = _scheduler(num_blocks, policy)
    _add(s, "p", PREFIX + [1, 2])
    _run(s)
    _add(s, "evictor", list(range(500, 500 + BS * num_blocks - 1)))  # every block
    _run(s)
    return s


def test_the_rest_is_computed_after_the_report_from_the_first_invalid_block():
    s = _evicted_prefix(12)
    _add(s, "w", PREFIX + [3, 4, 5])
    plan = _step(s)
    assert [op.block_index for op in plan.kv_async_onloads] == [0, 1, 2, 3]
    assert "w" not in plan.num_scheduled_tokens
    w = s.requests["w"]
    assert w.status == RequestStatus.WAITING_FOR_REMOTE_KVS and w.num_computed_tokens == 0
    assert _step(s).num_scheduled_tokens == {}  # nothing to run: it waits
    bad = plan.kv_async_onloads[2].block_id
    _step(s, finished_recving={"w"}, invalid={bad})
    assert w.status == RequestStatus.WAITING and w.num_computed_tokens == 2 * BS
    plan = _step(s)
    assert plan.num_scheduled_tokens == {"w": len(PREFIX) + 3 - 2 * BS}
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 2 * BS
    # The bad block's hash was forgotten: no later request onloads it again.
    assert w.block_hashes[2] not in s.kv_offload and w.block_hashes[1] in s.kv_offload


def test_a_queue_never_waits_on_blocks_an_onload_filled():
    """Priority: "x" (priority 0) is queued before "w" (priority 1), whose onload filled
    4 of the pool's 12 blocks; nothing runs, and "x" needs 9. "w" gives its blocks back
    (still cached), "x" runs, then "w" finds its prefix again."""
    s = _evicted_prefix(12, "priority")
    _add(s, "w", PREFIX + [3, 4, 5], priority=1)
    plan = _step(s)
    _add(s, "x", list(range(900, 933)), priority=0)  # 33 tokens: 9 blocks
    _step(s, finished_recving={"w"})
    w = s.requests["w"]
    assert w.num_computed_tokens == len(PREFIX) and w.holds_onloaded_blocks
    for _ in range(4):
        _step(s)
        if "x" not in s.requests:
            break
    assert "x" not in s.requests, "the queue waited on itself"
    _run(s)
    assert "w" not in s.requests and s.kv_cache_manager.pool.num_free_blocks == 12


def test_an_onload_starts_only_when_the_whole_request_fits():
    """The synchronous path admits a request only when all its blocks fit; the
    asynchronous one must not hold blocks through an onload that could never be
    followed by the rest (and would push running requests out meanwhile)."""
    s = _evicted_prefix(12)
    _add(s, "r", list(range(700, 724)), max_tokens=3)  # 24 tokens: 6 blocks, then 7
    _step(s)
    _add(s, "w", PREFIX + list(range(40, 52)))  # 28 tokens: 7 blocks, 4 in the tier
    plan = _step(s)
    assert plan.kv_async_onloads == [] and s.requests["w"].status == RequestStatus.WAITING
    assert s.kv_offload.num_loading == 0 and "w" not in s.kv_cache_manager.req_blocks
    _run(s)
    assert s.num_onload_waits == 1 and "w" not in s.requests

"""Scheduler behaviour with a scripted model (no torch model involved)."""

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.scheduler import Scheduler
from pagoda.messages import EngineCoreRequest, FinishReason, ModelRunnerOutput
from pagoda.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, block_size=4, caching=True):
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     max_model_len=256),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks)


def add(s, rid, n_prompt, max_tokens=4, **kw):
    s.add_request(EngineCoreRequest(rid, list(range(1, n_prompt + 1)),
                                    SamplingParams(max_tokens=max_tokens, **kw), [EOS]))


def step(s, token=7):
    """Schedule, then 'sample' `token` for every request that reached its known tokens."""
    so = s.schedule()
    req_ids, sampled = [], []
    for rid, n in so.num_scheduled_tokens.items():
        req = s.requests[rid]
        req_ids.append(rid)
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    return so, s.update_from_output(so, ModelRunnerOutput(req_ids, sampled))


def test_prefill_then_decode_until_length():
    s = make_scheduler()
    add(s, "a", 10, max_tokens=3)
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 10} and outs[0].new_token_ids == [7]
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 1}
    so, outs = step(s)
    assert outs[0].finish_reason == FinishReason.LENGTH
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.pool.num_free_blocks == 64


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    s = make_scheduler(budget=8)
    add(s, "a", 3, max_tokens=5)
    step(s)  # a prefilled, first token sampled
    add(s, "b", 20)
    so, outs = step(s)
    # Running decode first (1 token), then b gets the rest of the budget.
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    assert [o.request_id for o in outs] == ["a"]  # b's partial prefill samples nothing
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    so, outs = step(s)
    assert so.num_scheduled_tokens["b"] == 6 and any(o.request_id == "b" for o in outs)


def test_eos_and_stop_token_ids_and_min_tokens():
    s = make_scheduler()
    add(s, "eos", 4, max_tokens=10)
    add(s, "stop", 4, max_tokens=10, stop_token_ids=[7])
    add(s, "min", 4, max_tokens=10, min_tokens=2, stop_token_ids=[7])
    _, outs = step(s, token=7)
    reasons = {o.request_id: (o.finish_reason, o.stop_reason) for o in outs}
    assert reasons["stop"] == (FinishReason.STOP, 7)
    assert reasons["eos"] == (None, None)
    assert reasons["min"] == (None, None)
    _, outs = step(s, token=EOS)
    reasons = {o.request_id: o.finish_reason for o in outs}
    assert reasons == {"eos": FinishReason.STOP, "min": FinishReason.STOP}


def test_preemption_recomputes_and_frees_everything():
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens each need 2 blocks, and
    # growing both to 16 tokens needs 8 blocks -> the later one gets preempted.
    s = make_scheduler(num_blocks=6, budget=64, caching=False)
    add(s, "a", 8, max_tokens=8)
    add(s, "b", 8, max_tokens=8)
    preempted_any = False
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        so, _ = step(s)
        preempted_any |= "b" in so.preempted_req_ids
    assert preempted_any and s.num_preemptions >= 1
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.pool.num_free_blocks == 6


def test_fcfs_and_max_num_seqs():
    s = make_scheduler(max_seqs=2)
    for rid in "abc":
        add(s, rid, 4)
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_abort_frees_blocks_and_reports_once():
    s = make_scheduler()
    add(s, "a", 10)
    step(s)
    s.finish_requests(["a"], FinishReason.ABORT)
    assert s.kv_cache_manager.pool.num_free_blocks == 64
    outs = s.take_pending_outputs()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", FinishReason.ABORT)]
    so = s.schedule()
    assert so.finished_req_ids == {"a"}  # the worker is told to drop it


def test_prefix_hit_skips_cached_tokens():
    s = make_scheduler()
    add(s, "a", 12, max_tokens=1)
    step(s)
    add(s, "b", 12, max_tokens=1)
    so, outs = step(s)
    # 12 tokens = 3 full blocks; 2 are reused and the last block is recomputed.
    assert so.num_scheduled_tokens == {"b": 4}
    assert outs[0].num_cached_tokens == 8

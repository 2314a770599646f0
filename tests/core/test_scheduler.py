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


def test_blocks_filled_by_decoded_tokens_are_offered_to_later_prompts():
    """A decode step that fills a block caches it (the running loop's no-allocation
    shortcut must not skip that): a prompt repeating the prompt and the output hits it."""
    s = make_scheduler()  # blocks of 4 tokens
    add(s, "a", 4, max_tokens=5)  # one prompt block; its last step fills the second
    while s.requests:
        step(s)
    s.add_request(EngineCoreRequest("b", [1, 2, 3, 4, 7, 7, 7, 7, 7], SamplingParams(
        max_tokens=1), [EOS]))
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"b": 1}  # 8 of its 9 tokens were cached
    assert outs[0].num_cached_tokens == 8


def test_prefix_hit_skips_cached_tokens():
    s = make_scheduler()
    add(s, "a", 12, max_tokens=1)
    step(s)
    add(s, "b", 12, max_tokens=1)
    so, outs = step(s)
    # 12 tokens = 3 full blocks; 2 are reused and the last block is recomputed.
    assert so.num_scheduled_tokens == {"b": 4}
    assert outs[0].num_cached_tokens == 8


def test_a_request_preempted_after_it_was_planned_leaves_no_unwritten_block_cached():
    """Under the priority policy the victim may be a request already planned this step:
    its new full blocks were offered to the prefix cache when allocated, but the step no
    longer writes them. They must not stay cached: a prefix hit on them (here the victim's
    own re-admission) would read KV that was never computed."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=256,
                                  policy="priority", long_prefill_token_threshold=8),
                  CacheConfig(block_size=4, enable_prefix_caching=True), 7)
    prompt = list(range(1, 25))  # 6 blocks, prefilled 8 tokens a step
    s.add_request(EngineCoreRequest("a", prompt, SamplingParams(max_tokens=2), [EOS], priority=9))
    step(s)  # a: tokens 0-8
    s.add_request(EngineCoreRequest("b", list(range(100, 104)), SamplingParams(max_tokens=20),
                                    [EOS], priority=0))
    so, _ = step(s)  # a: tokens 8-16; b admitted after it: running is [a, b]
    assert so.num_scheduled_tokens == {"a": 8, "b": 4}
    a = s.requests["a"]
    so = s.schedule()  # a plans 16-24 (its last 2 free blocks, offered as cached); then
    # b's next token needs a block: a (priority 9) is preempted after it was planned.
    assert "a" in so.preempted_req_ids or a.num_preemptions == 1
    pool = s.kv_cache_manager.pool
    for index in (4, 5):  # the blocks that step would have written
        assert pool.get_cached_block(a.block_hashes[index],
                                     prompt[index * 4:index * 4 + 4]) is None, index
    # Re-admitted at once or later, it starts from at most what was written (16 tokens).
    assert a.num_computed_tokens <= 16

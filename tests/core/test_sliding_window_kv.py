"""The KV cache manager under a sliding window: blocks wholly before the window are
released as a request advances, ask-then-act still holds, and prefix caching never
serves a block whose KV is gone."""

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.kv_cache_manager import OUT_OF_WINDOW_BLOCK_ID, KVCacheManager
from pagoda.core.request import Request
from pagoda.core.scheduler import Scheduler
from pagoda.messages import EngineCoreRequest, ModelRunnerOutput
from pagoda.sampling_params import SamplingParams

BS = 4
SEED = "test-seed"
WINDOW = 6  # a query at p sees keys p-5 .. p


def make_request(rid: str, tokens: list[int], max_tokens: int = 64) -> Request:
    return Request(EngineCoreRequest(rid, tokens, SamplingParams(max_tokens=max_tokens)), BS,
                   SEED, 1024)


def manager(num_blocks: int = 16, window: int | None = WINDOW) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=True, max_model_len=1024,
                          sliding_window=window)


def run(mgr: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Schedule `num_tokens` more tokens of `request` as the scheduler would."""
    assert mgr.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens += num_tokens


def decode(mgr: KVCacheManager, request: Request, steps: int) -> None:
    for _ in range(steps):
        request.append_output_token(7)
        run(mgr, request, 1)


def test_blocks_before_the_window_are_released_as_the_request_decodes():
    mgr = manager()
    r = make_request("r", list(range(10)))
    run(mgr, r, 10)  # positions 0..9: three blocks
    assert mgr.num_held_blocks("r") == 3
    decode(mgr, r, 30)  # now 40 tokens; the next query (position 40) sees 35..40
    held = mgr.req_blocks["r"]
    # Blocks 0..7 (positions 0..31) are wholly before position 35 - 1: released.
    num_out = mgr.num_blocks_out_of_window(r.num_computed_tokens)
    assert num_out == (40 - WINDOW + 1) // BS == 8
    assert held[:num_out] == [None] * num_out and all(b is not None for b in held[num_out:])
    assert mgr.get_block_ids("r")[:num_out] == [OUT_OF_WINDOW_BLOCK_ID] * num_out
    assert mgr.num_held_blocks("r") <= -(-(WINDOW - 1 + 1) // BS) + 2
    assert mgr.pool.num_free_blocks == 16 - mgr.num_held_blocks("r")
    mgr.free(r)
    assert mgr.pool.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in mgr.pool.blocks)


def test_without_a_window_every_block_is_kept():
    mgr = manager(window=None)
    r = make_request("r", list(range(10)))
    run(mgr, r, 10)
    decode(mgr, r, 30)
    assert mgr.num_held_blocks("r") == 10 and None not in mgr.req_blocks["r"]


def test_released_blocks_count_as_free_for_the_same_step_and_failure_changes_nothing():
    mgr = manager(num_blocks=3)
    r = make_request("r", list(range(12)))
    run(mgr, r, 12)  # all three blocks
    r.append_output_token(7)
    # Position 12 sees 7..12: block 0 (0..3) is out. It makes room for block 3.
    new = mgr.allocate_slots(r, 1)
    assert new is not None and len(new) == 1 and mgr.req_blocks["r"][0] is None
    r.num_computed_tokens += 1
    # A second request cannot get two blocks: nothing of it (or of r) changes.
    other = make_request("o", list(range(100, 108)))
    before = list(mgr.req_blocks["r"])
    assert mgr.allocate_slots(other, 8) is None
    assert "o" not in mgr.req_blocks and mgr.req_blocks["r"] == before


def test_a_shared_block_is_released_only_by_its_last_holder():
    mgr = manager()
    a = make_request("a", list(range(12)))
    run(mgr, a, 12)
    b = make_request("b", list(range(12)) + [50, 51])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12
    assert mgr.allocate_slots(b, 2, hits, num_hit) is not None
    b.num_computed_tokens = 14
    first = mgr.req_blocks["a"][0]
    # b now at 14 (next query 14 sees 9..14): its block 0 goes, but a still holds it.
    decode(mgr, b, 1)
    assert mgr.req_blocks["b"][0] is None and first.ref_cnt == 1
    mgr.free(a)
    mgr.free(b)
    assert mgr.pool.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in mgr.pool.blocks)


def test_a_released_block_still_hits_until_it_is_reused_and_never_after():
    mgr = manager(num_blocks=6)
    prompt = list(range(16))
    a = make_request("a", prompt)
    run(mgr, a, 16)
    decode(mgr, a, 8)  # position 24 sees 19..24: blocks 0..3 released, still cached
    assert mgr.req_blocks["a"][:4] == [None] * 4
    b = make_request("b", prompt + [99])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 16  # the whole prompt: the released blocks kept their KV
    # A new request takes every free block, so released ones are reused (hash evicted).
    c = make_request("c", list(range(500, 516)))
    run(mgr, c, mgr.pool.num_free_blocks * BS)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 0  # block 0 was reused: the chain ends before it, nothing served


def test_hit_blocks_out_of_the_new_requests_window_are_not_taken():
    mgr = manager()
    a = make_request("a", list(range(20)))
    run(mgr, a, 20)
    mgr.free(a)  # five cached blocks, all free
    b = make_request("b", list(range(20)) + [77])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 20
    assert mgr.allocate_slots(b, 1, hits, num_hit) is not None
    # Position 20 sees 15..20: blocks 0..2 are not taken, blocks 3..4 are.
    assert mgr.req_blocks["b"][:3] == [None] * 3 and mgr.req_blocks["b"][3:5] == hits[3:]
    assert [h.ref_cnt for h in hits] == [0, 0, 0, 1, 1]
    assert mgr.get_block_ids("b")[:3] == [OUT_OF_WINDOW_BLOCK_ID] * 3


def test_scheduler_runs_a_sequence_longer_than_the_kv_cache_without_preempting():
    # 8 blocks of 4 = 32 tokens; the request grows to 20 + 60 = 80.
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=256),
                  CacheConfig(block_size=BS, enable_prefix_caching=True, sliding_window=WINDOW),
                  num_blocks=8)
    s.add_request(EngineCoreRequest("r", list(range(1, 21)), SamplingParams(max_tokens=60), []))
    outputs = []
    while s.has_unfinished_requests():
        so = s.schedule()
        assert so.total_num_scheduled_tokens > 0
        req_ids = list(so.num_scheduled_tokens)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else []
                   for r in req_ids]
        outputs += s.update_from_output(so, ModelRunnerOutput(req_ids, sampled))
    assert sum(len(o.new_token_ids) for o in outputs) == 60
    assert s.num_preemptions == 0
    assert s.kv_cache_manager.pool.num_free_blocks == 8

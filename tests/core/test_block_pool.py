"""Block pool and KV cache manager: allocation, hits, eviction order, ref counts."""

from pagoda.core.block_hash import hash_request_tokens
from pagoda.core.block_pool import BlockPool
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_events import BlockRemoved, BlockStored
from pagoda.core.request import Request
from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams

BS = 4
SEED = "test-seed"


def make_request(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(EngineCoreRequest(rid, tokens, SamplingParams(max_tokens=max_tokens)), BS, SEED, 1024)


def test_hashes_chain_and_are_deterministic():
    a = hash_request_tokens(list(range(10)), BS, SEED)
    b = hash_request_tokens(list(range(10)), BS, SEED)
    assert a == b and len(a) == 2  # the partial third block has no hash
    # Same second block, different first block: the chain makes them differ.
    c = hash_request_tokens([9, 9, 9, 9] + list(range(4, 8)), BS, SEED)
    assert c[1] != a[1]
    assert hash_request_tokens(list(range(8)), BS, "other-seed") != a


def test_allocate_is_all_or_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True, max_model_len=64)
    r1 = make_request("r1", list(range(12)))
    assert len(mgr.allocate_slots(r1, 12)) == 3
    r2 = make_request("r2", list(range(100, 108)))
    assert mgr.allocate_slots(r2, 8) is None  # needs 2, only 1 free
    assert mgr.pool.num_free_blocks == 1 and "r2" not in mgr.req_blocks


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True, max_model_len=64)
    r1 = make_request("r1", list(range(8)))
    mgr.allocate_slots(r1, 8)
    r1.num_computed_tokens = 8
    mgr.free(r1)
    r2 = make_request("r2", list(range(8)))
    hits, num = mgr.get_computed_blocks(r2)
    # Both blocks are cached but the last token must be recomputed for logits.
    assert num == 4 and len(hits) == 1
    r3 = make_request("r3", list(range(8)) + [50, 51])
    hits, num = mgr.get_computed_blocks(r3)
    assert num == 8
    assert [b.token_ids for b in hits] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    mgr.allocate_slots(r3, 2, hits, num)
    assert all(b.ref_cnt == 1 for b in hits)
    assert mgr.prefix_stats.hits == 12


def test_hash_collision_is_rejected_by_token_comparison():
    pool = BlockPool(4, BS, enable_caching=True)
    req = make_request("r", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, req.block_hashes, req.all_token_ids, 0, 1)
    assert pool.get_cached_block(req.block_hashes[0], [1, 2, 3, 4]) is blocks[0]
    assert pool.get_cached_block(req.block_hashes[0], [1, 2, 3, 5]) is None


def test_eviction_is_lru_and_tail_first():
    mgr = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True, max_model_len=64)
    r1 = make_request("r1", list(range(8)))
    mgr.allocate_slots(r1, 8)
    first, second = mgr.req_blocks["r1"]
    mgr.free(r1)
    mgr.take_events()
    r2 = make_request("r2", list(range(100, 112)))
    mgr.allocate_slots(r2, 12)
    # Two never-used blocks go first, then the tail block of r1; its head survives.
    assert mgr.pool.get_cached_block(r1.block_hashes[1], range(4, 8)) is None
    assert mgr.pool.get_cached_block(r1.block_hashes[0], range(0, 4)) is first
    events = mgr.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed and removed[0].block_hashes == [r1.block_hashes[1]]
    assert any(isinstance(e, BlockStored) for e in events)


def test_shared_blocks_ref_counts_and_no_leak():
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True, max_model_len=64)
    r1 = make_request("r1", list(range(9)))
    mgr.allocate_slots(r1, 9)
    r2 = make_request("r2", list(range(9)))
    hits, num = mgr.get_computed_blocks(r2)
    mgr.allocate_slots(r2, 9 - num, hits, num)
    assert mgr.req_blocks["r1"][0].ref_cnt == 2
    mgr.free(r1)
    mgr.free(r2)
    assert mgr.pool.num_free_blocks == 8
    assert all(b.ref_cnt == 0 for b in mgr.pool.blocks)


def test_no_caching_means_no_hits():
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False, max_model_len=64)
    r1 = make_request("r1", list(range(9)))
    mgr.allocate_slots(r1, 9)
    mgr.free(r1)
    assert mgr.get_computed_blocks(make_request("r2", list(range(9)))) == ([], 0)
    assert mgr.take_events() == []

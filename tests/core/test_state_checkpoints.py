"""The scheduler's index of recurrent-state checkpoints (hybrid models' prefix cache):
what makes a saved state findable, and what takes it away."""

from __future__ import annotations

from pagoda.core.block_pool import BlockPool
from pagoda.core.state_checkpoints import StateCheckpoints


def test_a_state_is_findable_only_after_its_step_ran():
    index = StateCheckpoints(2)
    index.start_step()
    slot = index.reserve(b"h1")
    assert index.lookup(b"h1") is None and index.has(b"h1")  # saved by this very step
    index.commit(lambda h: True)
    index.start_step()
    assert index.lookup(b"h1") == slot


def test_a_step_that_never_reported_loses_its_saves():
    index = StateCheckpoints(1)
    index.start_step()
    index.reserve(b"h1")
    index.start_step()  # the step failed: no commit came
    assert not index.has(b"h1")
    assert index.reserve(b"h2") is not None  # its slot came back


def test_lru_eviction_never_takes_a_slot_this_step_uses():
    index = StateCheckpoints(2)
    index.start_step()
    a, b = index.reserve(b"a"), index.reserve(b"b")
    index.commit(lambda h: True)
    index.start_step()
    assert index.lookup(b"a") == a  # restored this step: pinned (and now most recent)
    assert index.reserve(b"c") == b  # "b" was the least recently used one not pinned
    assert index.reserve(b"d") is None  # "a" is pinned, "c" is being saved
    index.commit(lambda h: True)
    index.start_step()
    assert index.lookup(b"b") is None and index.lookup(b"c") == b


def test_a_block_evicted_from_the_pool_takes_its_state_along():
    pool = BlockPool(2, 4, enable_caching=True, enable_kv_events=False)
    index = StateCheckpoints(2)
    pool.on_evict = index.forget
    [block] = pool.get_new_blocks(1)
    pool.cache_block(block, [b"h"], [1, 2, 3, 4], 0)
    index.start_step()
    index.reserve(b"h")
    index.commit(pool.is_cached)
    assert index.has(b"h")
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert not index.has(b"h")


def test_a_save_whose_block_is_no_longer_cached_is_dropped():
    index = StateCheckpoints(1)
    index.start_step()
    index.reserve(b"gone")
    index.commit(lambda h: False)
    assert not index.has(b"gone")
    index.start_step()
    assert index.reserve(b"next") is not None


def test_the_worker_refuses_a_checkpoint_slot_it_does_not_have():
    """The gpu-worker's plan check (a scheduler and a worker started with another
    max_num_seqs would disagree on the slots): refused by request, before anything ran."""
    import pytest

    from pagoda.messages import CachedRequestData, NewRequestData, SchedulerOutput
    from pagoda.sampling_params import SamplingParams
    from pagoda.worker.plan_checks import PlanLedger, PlanRejected

    ledger = PlanLedger(8, 4, 100, 64, num_state_checkpoints=2)

    def plan(restore=None, saves=None, computed=4):
        new = NewRequestData("r", list(range(9)), [], SamplingParams(), [0, 1, 2], computed,
                             state_restore=restore)
        out = SchedulerOutput([new], CachedRequestData(), {"r": 9 - computed}, 9 - computed)
        out.state_saves = saves or {}
        return out

    ledger.check(plan(restore=1, saves={"r": (4, 0)}))
    for bad in (plan(restore=2), plan(restore=0, computed=0), plan(saves={"r": (4, 2)}),
                plan(saves={"r": (6, 0)}), plan(saves={"other": (1, 0)})):
        with pytest.raises(PlanRejected, match="state checkpoint"):
            ledger.check(bad)

"""The host KV tier's pieces alone: the scheduler's LRU index and the worker's copies
(any cache layout, checksums, recompute on a bad slot)."""

from __future__ import annotations

import pytest
import torch

from pagoda.core.kv_disk_index import KVDiskIndex
from pagoda.core.kv_offload import KVOffloadIndex, num_host_slots
from pagoda.messages import (CachedRequestData, KVOffload, KVOnload, KVSpill, NewRequestData,
                             SchedulerOutput)
from pagoda.sampling_params import SamplingParams
from pagoda.worker.disk_kv_tier import DiskKVTier, layout_identity
from pagoda.worker.host_kv_tier import HostKVTier

H = [bytes([i]) * 8 for i in range(10)]
TOKENS = [tuple(range(4 * i, 4 * i + 4)) for i in range(10)]


def test_the_index_evicts_the_least_recently_used_and_never_a_pinned_slot():
    index = KVOffloadIndex(2, 100)
    index.offload(7, H[0], TOKENS[0])
    index.offload(8, H[1], TOKENS[1])
    offloads, *_ = index.take_ops()
    assert [(o.block_id, o.slot) for o in offloads] == [(7, 0), (8, 1)]
    flat = [t for tokens in TOKENS for t in tokens]
    assert index.lookup(H, flat, 0, 3, 4) == [(0, H[0]), (1, H[1])]  # both held, now pinned
    index.offload(9, H[2], TOKENS[2])  # every slot pinned: dropped
    assert H[2] not in index and len(index) == 2
    index.take_ops()  # the step ends: pins end
    index.offload(9, H[2], TOKENS[2])  # H[0] is the least recently used
    assert H[0] not in index and H[2] in index and index.stats.evictions == 1
    # A hash held already is copied again into its own slot (a bad copy heals).
    index.offload(3, H[1], TOKENS[1])
    offloads, *_ = index.take_ops()
    assert [(o.block_id, o.slot) for o in offloads] == [(9, 0), (3, 1)]


def test_a_lookup_stops_at_the_first_miss_or_other_tokens():
    index = KVOffloadIndex(4, 100)
    for i in (0, 1, 3):
        index.offload(i, H[i], TOKENS[i])
    flat = [t for tokens in TOKENS for t in tokens]
    assert len(index.lookup(H, flat, 0, 4, 4)) == 2
    other = list(flat)
    other[1] = 999  # same hash, other tokens (a collision): no hit
    assert index.lookup(H, other, 0, 4, 4) == []


def test_sizes():
    assert num_host_slots(0, 100) == 0 and num_host_slots(1e-6, 100) == 10
    with pytest.raises(ValueError):
        KVOffloadIndex(0, 100)


@pytest.mark.parametrize("value_dim", [8, 0])  # K/V heads, or a latent (MLA: no values)
def test_the_worker_copies_whole_blocks_and_recomputes_a_bad_one(value_dim):
    caches = [(torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, value_dim)) for _ in range(3)]
    tier = HostKVTier(caches, 3)
    want = [(k[1].clone(), v[1].clone(), k[2].clone()) for k, v in caches]
    tier.offload(caches, [KVOffload(1, 0, H[0]), KVOffload(2, 1, H[1])])
    data = NewRequestData("r", list(range(13)), [], SamplingParams(), [4, 5, 0, 3], 8)
    plan = SchedulerOutput([data], CachedRequestData(), {"r": 5}, 5,
                           kv_onloads=[KVOnload("r", 0, 0, 4, H[0]), KVOnload("r", 1, 1, 5, H[1])])
    assert tier.apply(caches, plan, 4) is plan
    for (k, v), (k1, v1, k2) in zip(caches, want):
        assert torch.equal(k[4], k1) and torch.equal(v[4], v1) and torch.equal(k[5], k2)
    tier.tensors[0][0][1].view(torch.uint8).bitwise_xor_(1)  # slot 1 goes bad
    ran = tier.apply(caches, plan, 4)
    assert tier.stats.failed_onloads == 1
    # Block 1 onward is recomputed this step: 4 more tokens, the same end.
    assert ran.scheduled_new_reqs[0].num_computed_tokens == 4
    assert ran.num_scheduled_tokens == {"r": 9} and ran.total_num_scheduled_tokens == 9


# ---------------------------------------------------------------- the disk tier below
def _disk_index(num_slots: int = 2, num_records: int = 3) -> KVOffloadIndex:
    return KVOffloadIndex(num_slots, 100, KVDiskIndex(num_records))


def test_the_host_tier_spills_what_it_evicts_and_the_disk_drops_its_lru():
    index = _disk_index()
    for i in range(2):
        index.offload(i, H[i], TOKENS[i])
    index.take_ops()
    index.offload(2, H[2], TOKENS[2])  # evicts H[0] from slot 0: spilled from the slot
    _, _, spills, drops = index.take_ops()
    assert spills == [KVSpill(0, H[0])] and drops == [] and H[0] in index.disk
    for i in range(3, 6):  # H[1], H[2], H[3] spill; the disk (3 records) drops H[0]
        index.offload(i, H[i], TOKENS[i])
        index.take_ops()
    assert list(index.disk._entries) == [H[1], H[2], H[3]] and index.disk_stats.evictions == 1
    flat = [t for tokens in TOKENS for t in tokens]
    # Blocks 1-3 from disk (slot -1), 4 and 5 from the host; block 0 is gone: no hit.
    assert index.lookup(H, flat, 1, 6, 4) == [(-1, H[1]), (-1, H[2]), (-1, H[3]),
                                              (0, H[4]), (1, H[5])]
    assert index.lookup(H, flat, 0, 6, 4) == []


def test_a_record_onloaded_this_step_is_never_dropped_by_it():
    """A block evicted mid-onload: the step that onloads H[1] from disk cannot drop it."""
    index = _disk_index(num_slots=1, num_records=1)
    index.offload(0, H[0], TOKENS[0])
    index.take_ops()
    index.offload(1, H[1], TOKENS[1])  # H[0] -> disk
    index.take_ops()
    flat = [t for tokens in TOKENS for t in tokens]
    assert index.lookup(H, flat, 0, 1, 4) == [(-1, H[0])]  # pinned on disk
    index.offload(2, H[2], TOKENS[2])  # H[1] would go to disk: the one record is pinned
    index.plan_onloads("r", 0, [(-1, H[0])], [7])
    _, onloads, spills, drops = index.take_ops()
    assert drops == [] and spills == [] and H[0] in index.disk
    assert onloads == [KVOnload("r", 0, -1, 7, H[0], "disk")]


def test_a_slot_taken_twice_in_one_step_keeps_only_its_last_copy():
    """The tier churns within one step: the block that lost the slot is spilled from its
    device block, and only the slot's last offload is planned (copies of one step may
    run in any order on CUDA)."""
    index = _disk_index(num_slots=1, num_records=4)
    index.offload(5, H[0], TOKENS[0])
    index.offload(6, H[1], TOKENS[1])  # takes slot 0 again in the same step
    offloads, _, spills, _ = index.take_ops()
    assert offloads == [KVOffload(6, 0, H[1])]
    assert spills == [KVSpill(0, H[0], 5)]


def test_the_worker_writes_verifies_and_refuses_records(tmp_path):
    caches = [(torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)) for _ in range(2)]
    disk = DiskKVTier(tmp_path, 4, layout_identity(("m",)))
    tier = HostKVTier(caches, 2, disk)
    tier.offload(caches, [KVOffload(1, 0, H[0])])
    tier.spill(caches, [KVSpill(0, H[0]), KVSpill(1, H[1]), KVSpill(0, H[2], 2)])
    assert disk.stats.written_blocks == 2  # slot 1 never held H[1]: not written
    data = NewRequestData("r", list(range(13)), [], SamplingParams(), [4, 5, 0, 3], 8)

    def onload(drops=()):
        plan = SchedulerOutput([data], CachedRequestData(), {"r": 5}, 5, kv_onloads=[
            KVOnload("r", 0, -1, 4, H[0], "disk"), KVOnload("r", 1, -1, 5, H[2], "disk")],
            kv_disk_drops=list(drops))
        return tier.apply(caches, plan, 4)

    assert onload().num_scheduled_tokens == {"r": 5}
    for k, v in caches:
        assert torch.equal(k[4], k[1]) and torch.equal(v[5], v[2])
    # Dropped in the same step as its onload (the scheduler never plans it): recomputed.
    ran = onload(drops=[H[2]])
    assert ran.num_scheduled_tokens == {"r": 9} and disk.stats.failed_reads == 1
    # A record of another model or layout, or another epoch: refused.
    other = DiskKVTier(tmp_path / "other", 4, layout_identity(("n",)))
    (other.path / disk._file(H[0]).name).write_bytes(disk._file(H[0]).read_bytes())
    assert other.read(H[0], tier.block_bytes) is None
    # Another worker of rank 0 on the same path (a second replica): its own directory.
    second = DiskKVTier(tmp_path, 4, disk.identity)
    assert second.path.parent.name == "rank0.1" and disk.path.exists()


@pytest.mark.parametrize("hash_len", [5, 8, 32])
def test_a_record_onloads_whatever_its_hash_length(tmp_path, hash_len):
    """Any hash length round-trips (the payload starts 64-byte aligned after it)."""
    caches = [(torch.randn(4, 4, 2, 8, dtype=torch.float64),
               torch.randn(4, 4, 2, 8, dtype=torch.float64))]
    tier = HostKVTier(caches, 1, DiskKVTier(tmp_path, 4, layout_identity(("m",))))
    block_hash = bytes(range(hash_len))
    tier.offload(caches, [KVOffload(1, 0, block_hash)])
    tier.spill(caches, [KVSpill(0, block_hash)])
    assert tier.onload_disk(caches, [KVOnload("r", 0, -1, 3, block_hash, "disk")]) == []
    assert torch.equal(caches[0][0][3], caches[0][0][1])
    assert torch.equal(caches[0][1][3], caches[0][1][1])


def test_slots_and_records_an_async_onload_reads_are_held_across_steps():
    """Asynchronous onloads: the step's pin rule, kept until `finish_onloads`. The held
    host slot is neither reused by a later step's offload nor copied into again, the held
    disk record neither dropped nor rewritten; once finished, both may be."""
    index = _disk_index(num_slots=2, num_records=1)
    index.offload(0, H[0], TOKENS[0])
    index.offload(1, H[1], TOKENS[1])
    index.take_ops()
    index.offload(2, H[2], TOKENS[2])  # H[0] -> disk (the one record), slot 0 -> H[2]
    index.take_ops()
    flat = [t for tokens in TOKENS for t in tokens]
    hits = index.lookup(H, flat, 0, 2, 4)
    assert hits == [(-1, H[0]), (1, H[1])]
    index.plan_onloads("r", 0, hits, [7, 8], asynchronous=True)
    offloads, onloads, _, _ = index.take_ops()
    assert onloads == [] and index.take_async_onloads() == [
        KVOnload("r", 0, -1, 7, H[0], "disk"), KVOnload("r", 1, 1, 8, H[1])]
    for step in range(2):  # later steps, the copies still running
        # Two new blocks: the second finds the held H[1] least recently used, and
        # must take slot 0 again rather than it.
        index.offload(10 + step, H[3 + 2 * step], TOKENS[3 + 2 * step])
        index.offload(11 + step, H[4 + 2 * step], TOKENS[4 + 2 * step])
        index.offload(20, H[1], TOKENS[1])  # the held one, evicted from the device again
        offloads, _, spills, drops = index.take_ops()
        assert [o.slot for o in offloads] == [0]
        assert H[0] not in drops and all(s.block_hash != H[0] for s in spills)
        assert H[0] in index.disk and H[1] in index
    index.finish_onloads("r")
    assert index.num_loading == 0
    index.offload(30, H[1], TOKENS[1])  # no longer held: copied again (a bad copy heals)
    index.offload(31, H[8], TOKENS[8])  # takes a slot; its spill drops the old record
    offloads, _, spills, drops = index.take_ops()
    assert [(o.block_id, o.slot) for o in offloads][0] == (30, 1)
    assert H[0] in drops and H[0] not in index.disk


def test_held_run_counts_host_then_disk_blocks_in_a_row_and_pins_nothing():
    """What a peer's prefix lease asks (services/scheduler/kv_tier_lease.py): the run
    from `start` on the host tier or on disk, tokens checked, with no pin and no query
    counted (it is not a lookup: nothing is onloaded by it)."""
    disk = KVDiskIndex(4)
    index = KVOffloadIndex(2, 100, disk)
    index.offload(7, H[1], TOKENS[1])
    index.offload(8, H[2], TOKENS[2])
    disk.spill(-1, H[3], TOKENS[3])
    flat = [t for tokens in TOKENS for t in tokens]
    assert index.held_run(H, flat, 1, 4) == 3  # 1, 2 on the host, 3 on disk, 4 nowhere
    assert index.held_run(H, flat, 0, 4) == 0  # block 0 is in no tier
    other = list(flat)
    other[2 * 4] += 1  # block 2's tokens differ: the run ends before it
    assert index.held_run(H, other, 1, 4) == 1
    assert index.stats.queries == 0 and index._pinned == set() and disk._pinned == set()

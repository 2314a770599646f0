"""The host-memory KV tier (--kv-offloading-size): prefixes evicted from a small device
pool come back from host memory, and greedy output never changes.

Workload: four 40-token prefixes, each far more than a fifth of a 24-block pool, sent
one after the other and then revisited with new suffixes, so every revisit misses the
device pool. With the tier the revisits onload their prefix; without it they recompute.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.engine.arg_utils import EngineArgs
from pagoda.core.kv_offload import GIB

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK = 4
TINY_BLOCK_BYTES = 3 * 2 * BLOCK * 2 * 16 * 4  # layers x (k, v) x tokens x heads x dim x f32


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(7)
    prefixes = [[1] + [rng.randrange(3, 40000) for _ in range(39)] for _ in range(4)]
    first = [p + [rng.randrange(3, 40000) for _ in range(3)] for p in prefixes]
    revisits = [p + [rng.randrange(3, 40000) for _ in range(5)] for p in prefixes]
    return first, revisits


def _llm(model: str, num_blocks: int, tier_blocks: int | None) -> LLM:
    kwargs = {} if tier_blocks is None else {
        "kv_offloading_size": tier_blocks * TINY_BLOCK_BYTES / GIB,
        "kv_offloading_backend": "native"}
    return LLM(model, dtype="float32", block_size=BLOCK, max_model_len=256,
               num_gpu_blocks_override=num_blocks, max_num_batched_tokens=64, **kwargs)


def _run(llm: LLM, prompts) -> list[list[int]]:
    out = []
    for p in prompts:  # one at a time: each evicts the earlier prefixes
        result = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
        out.append(list(result[0].outputs[0].token_ids))
    return out


def _tier(llm: LLM):
    core = llm.llm_engine.core
    return core.scheduler.kv_offload, core.executor.runner.host_tier


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Outputs of a pool big enough never to evict, and of the small pool without a tier."""
    first, revisits = _prompts()
    big = _llm(tiny_llama_dir, 512, None)
    small = _llm(tiny_llama_dir, 24, None)
    want = _run(big, first + revisits)
    assert _run(small, first + revisits) == want
    return want


@pytest.fixture(params=["serial", "threads"])
def checksums(request, monkeypatch):
    """Slot checksums on this thread (hosts of under 4 cores, CI's) or on a pool (GPU
    hosts): both must verify the same slots."""
    import pagoda.worker.host_kv_tier as tier_module

    pool = ThreadPoolExecutor(2) if request.param == "threads" else None
    monkeypatch.setattr(tier_module, "_POOL", [pool])
    yield request.param
    if pool is not None:
        pool.shutdown()


def test_revisits_onload_from_the_host_tier_with_the_same_output(tiny_llama_dir, reference,
                                                                 checksums):
    first, revisits = _prompts()
    llm = _llm(tiny_llama_dir, 24, tier_blocks=64)
    index, tier = _tier(llm)
    assert tier.num_slots == 64 and tier.block_bytes == TINY_BLOCK_BYTES
    assert _run(llm, first + revisits) == reference
    stats = llm.llm_engine.core.get_stats().kv_offload
    # Each revisit's 10 prefix blocks (39 of 40 tokens: the last one is recomputed)
    # were evicted from the device pool and came back from the tier.
    assert stats.hits >= 4 * 9
    assert tier.stats.onloaded_blocks == stats.hits and tier.stats.failed_onloads == 0
    assert stats.stored >= 4 * 9 and tier.stats.offloaded_blocks == stats.stored
    assert llm.llm_engine.core.scheduler.requests == {}


def test_a_corrupted_block_is_recomputed(tiny_llama_dir, reference, checksums):
    first, revisits = _prompts()
    llm = _llm(tiny_llama_dir, 24, tier_blocks=64)
    index, tier = _tier(llm)
    assert _run(llm, first) == reference[:4]
    # Flip bits of every slot the tier holds: the next onloads fail their CRC.
    for pair in tier.tensors:
        for t in pair:
            t.view(torch.uint8).bitwise_xor_(0x5A)
    assert _run(llm, revisits[:1]) == reference[4:5]
    assert tier.stats.failed_onloads == 10 and tier.stats.onloaded_blocks == 0
    # The recomputed blocks are offloaded again when evicted: the slots heal.
    assert _run(llm, revisits[1:] + first) == reference[5:] + reference[:4]
    assert _run(llm, revisits[:1]) == reference[4:5]
    assert tier.stats.onloaded_blocks >= 10


def test_a_slot_the_worker_lost_is_recomputed(tiny_llama_dir, reference):
    """The index names a slot the worker no longer holds (a restarted worker, a block
    evicted from the tier behind the scheduler's back): recompute, same answer."""
    first, revisits = _prompts()
    llm = _llm(tiny_llama_dir, 24, tier_blocks=64)
    index, tier = _tier(llm)
    assert _run(llm, first) == reference[:4]
    tier._hash = [None] * tier.num_slots
    assert _run(llm, revisits[:1]) == reference[4:5]
    assert tier.stats.failed_onloads == 10 and tier.stats.onloaded_blocks == 0


def test_a_full_tier_keeps_the_most_recent_blocks(tiny_llama_dir, reference):
    """12 slots hold about one prefix: the tier evicts LRU, so the oldest prefix is
    recomputed, a recent one hits, and the output never changes."""
    first, revisits = _prompts()
    llm = _llm(tiny_llama_dir, 24, tier_blocks=12)
    index, tier = _tier(llm)
    assert _run(llm, first) == reference[:4]
    assert len(index) == 12 and index.stats.evictions > 0
    assert _run(llm, [revisits[0]]) == [reference[4]]  # long gone from the tier
    assert index.stats.hits == 0
    assert _run(llm, revisits[2:]) == reference[6:]  # evicted from the device last
    assert 0 < index.stats.hits < 2 * 10
    assert len(index) == 12 and tier.stats.failed_onloads == 0


@pytest.mark.parametrize("size", [None, 0])
def test_no_tier_without_a_size(tiny_llama_dir, reference, size):
    first, revisits = _prompts()
    kwargs = {} if size is None else {"kv_offloading_size": size}
    llm = LLM(tiny_llama_dir, dtype="float32", block_size=BLOCK, max_model_len=256,
              num_gpu_blocks_override=24, max_num_batched_tokens=64, **kwargs)
    index, tier = _tier(llm)
    assert index is None and tier is None
    assert _run(llm, first + revisits) == reference
    assert llm.llm_engine.core.get_stats().kv_offload is None


def test_bad_flags_are_refused_by_name(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLM(tiny_llama_dir, kv_offloading_size=-1)
    with pytest.raises(ValueError, match="kv_offloading_backend"):
        LLM(tiny_llama_dir, kv_offloading_size=1, kv_offloading_backend="lmcache")


@pytest.mark.parametrize("extra", [dict(async_scheduling=True)], ids=["async-scheduling"])
def test_the_tier_refuses_what_it_cannot_keep_exact(tiny_llama_dir, extra):
    with pytest.raises(ValueError, match="--kv-offloading-size is not supported with"):
        EngineArgs(model=tiny_llama_dir, dtype="float32", kv_offloading_size=0.01,
                   **extra).create_engine_config()


def test_blocks_evicted_into_the_tier_are_published_as_medium_cpu(tiny_llama_dir):
    """The prefix index's view (KV events): an evicted prefix leaves the device ("GPU")
    and enters the host tier ("CPU"); what the events say is what each medium holds."""
    first, _ = _prompts()
    llm = _llm(tiny_llama_dir, 24, tier_blocks=64)
    core = llm.llm_engine.core
    events, take = [], core.take_kv_events
    core.take_kv_events = lambda: events.extend(take()) or []
    _run(llm, first)
    held = {"GPU": set(), "CPU": set()}
    for event in events:
        if type(event).__name__ == "BlockStored":
            held[event.medium].update(event.block_hashes)
        elif type(event).__name__ == "BlockRemoved":
            held[event.medium].difference_update(event.block_hashes)
    index, _ = _tier(llm)
    assert held["CPU"] == set(index._entries) and len(held["CPU"]) >= 9
    assert held["GPU"] == set(core.cached_block_hashes())
    assert not held["CPU"] & held["GPU"]  # evicted, not onloaded back
    # A resync: the snapshot carries the device's blocks, the tier publishes its again.
    assert set(core.kv_index_snapshot()) == held["GPU"]
    again = [e for e in take() if e.medium == "CPU"]
    assert [type(e).__name__ for e in again] == ["BlockStored"]
    assert set(again[0].block_hashes) == held["CPU"]

"""A P/D import (the decode side's `plan_import`) and the host KV tier: a cached block the
import takes for a pulled block is evicted from the device without being offloaded.

Why it must be so: the tier's copies run with the next step (`KVOffloadIndex` plans
them, the worker runs them before the forward), but the worker's FetchBlocks writes
the pulled bytes into the block as soon as the plan exists, between steps. An offload
planned by the import would copy the pulled block's bytes into the tier under the
evicted block's hash: a wrong answer for whoever onloads that hash later. Blocks a
step evicts are offloaded (their KV is intact until that step's forward).
"""

from __future__ import annotations

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.kv_offload import KVOffloadIndex
from pagoda.core.scheduler import Scheduler
from pagoda.kv_transfer.imports import plan_import
from pagoda.messages import EngineCoreRequest, ModelRunnerOutput
from pagoda.sampling_params import SamplingParams

BLOCK = 4


def run_to_end(s: Scheduler, request_id: str, prompt: list[int]):
    """One request alone until it ends; each step's offloads."""
    s.add_request(EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=1), [0]))
    offloads = []
    while s.has_unfinished_requests():
        plan = s.schedule()
        offloads += plan.kv_offloads
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else []
                   for r in plan.num_scheduled_tokens]
        s.update_from_output(plan, ModelRunnerOutput(list(plan.num_scheduled_tokens), sampled))
    return offloads


def test_blocks_an_import_reuses_are_not_offloaded_but_a_steps_are():
    index = KVOffloadIndex(16, 100)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                  CacheConfig(block_size=BLOCK, enable_prefix_caching=True), 5,
                  kv_offload=index)
    pool = s.kv_cache_manager.pool
    assert run_to_end(s, "r1", list(range(1, 18))) == []  # 4 full blocks cached, then freed
    # A step that needs the pool evicts r1's blocks: each is offloaded.
    offloaded = run_to_end(s, "r2", list(range(100, 117)))
    assert len(offloaded) == 4 and len(index) == 4
    # A step more (one block, the uncached one): r2's blocks were written by an earlier
    # step, so a step evicting them now would offload them.
    assert run_to_end(s, "r3", [300, 301, 302]) == []
    # An import (between steps) takes r2's cached blocks for pulled ones.
    r2_hashes = set(pool.cached_hashes())
    assert len(r2_hashes) == 4
    pulled = [bytes([i]) * 8 for i in range(5)]
    plan = plan_import(pool, pulled, list(range(200, 220)))
    assert len(plan.targets) == 5 and not r2_hashes & set(pool.cached_hashes())
    offloads, onloads, _, _ = index.take_ops()
    assert offloads == [] and onloads == []
    assert not any(h in index for h in r2_hashes)
    # Nor by the next step, which runs the tier's copies (and reads nothing of them).
    plan_next = s.schedule()
    assert plan_next.kv_offloads == []

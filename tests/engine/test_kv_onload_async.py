"""Asynchronous onload from the KV tiers (--kv-offloading-onload async, the default): a
request whose prefix is in the host tier waits out of the batch while the worker
copies it in the background, the other requests keep stepping, and every answer
equals that of a pool that never evicts.

The loader thread is held back with a gate (`_gate`), so "while the copies run" is a
state the test controls, not a race it hopes to hit.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.core.kv_offload import GIB
from pagoda.core.request import RequestStatus
from pagoda.messages import EngineCoreRequest, FinishReason
from tests.engine.test_kv_offload import BLOCK, GREEDY, TINY_BLOCK_BYTES, _prompts, _run

DECODE_PROMPT = [1, 17, 923, 4410, 87, 3001, 12]
LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _llm(model: str, onload: str = "async", num_blocks: int = 24) -> LLM:
    return LLM(model, dtype="float32", block_size=BLOCK, max_model_len=256,
               num_gpu_blocks_override=num_blocks, max_num_batched_tokens=64,
               kv_offloading_size=64 * TINY_BLOCK_BYTES / GIB, kv_offloading_onload=onload)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Outputs of a pool that never evicts: the prompts, then the decode stream."""
    first, revisits = _prompts()
    big = LLM(tiny_llama_dir, dtype="float32", block_size=BLOCK, max_model_len=256,
              num_gpu_blocks_override=512, max_num_batched_tokens=64)
    decode = big.generate([{"prompt_token_ids": DECODE_PROMPT}], LONG, use_tqdm=False)
    return _run(big, first + revisits), list(decode[0].outputs[0].token_ids)


def _gate(tier) -> threading.Event:
    """Hold every asynchronous onload until the returned event is set."""
    opened = threading.Event()
    copy = tier.onload_blocks

    def gated(kv_caches, ops):
        opened.wait(30)
        return copy(kv_caches, ops)

    tier.onload_blocks = gated
    return opened


class _Stream:
    """Drives the engine core step by step, collecting each request's tokens."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.llm_engine.core
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, FinishReason] = {}
        self.cached: dict[str, int] = {}

    def add(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.core.add_request(EngineCoreRequest(req_id, list(prompt), params))
        self.tokens[req_id] = []

    def step(self) -> None:
        for out in self.core.step():
            self.tokens[out.request_id] += out.new_token_ids
            self.cached[out.request_id] = out.num_cached_tokens
            if out.finish_reason is not None:
                self.finished[out.request_id] = out.finish_reason

    def run_until(self, done, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError("the engine did not get there")


def test_a_revisit_waits_out_of_the_batch_while_others_decode(tiny_llama_dir, reference):
    want, want_decode = reference
    first, revisits = _prompts()
    llm = _llm(tiny_llama_dir)
    tier = llm.llm_engine.core.executor.runner.host_tier
    assert _run(llm, first) == want[:4]
    opened = _gate(tier)
    s = _Stream(llm)
    s.add("decode", DECODE_PROMPT, LONG)
    s.run_until(lambda: len(s.tokens["decode"]) >= 2)
    s.add("revisit", revisits[0], GREEDY)
    scheduler = s.core.scheduler
    s.step()
    assert scheduler.requests["revisit"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = list(scheduler.kv_cache_manager.req_blocks["revisit"])
    # Its tier blocks are held for it, and not offered as cached before their KV is there.
    assert len(blocks) == 10 and all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)
    before = len(s.tokens["decode"])
    for _ in range(5):  # the copies are held back: the decode goes on without them
        s.step()
        assert "revisit" not in s.core.last_scheduler_output.num_scheduled_tokens
    assert len(s.tokens["decode"]) == before + 5
    assert scheduler.requests["revisit"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    opened.set()
    s.run_until(lambda: scheduler.requests["revisit"].status == RequestStatus.RUNNING)
    assert all(b.block_hash is not None for b in blocks)  # offered once loaded
    s.run_until(lambda: len(s.finished) == 2)
    assert s.tokens["revisit"] == want[4] and s.tokens["decode"] == want_decode
    assert s.cached["revisit"] == 10 * BLOCK  # 45 prompt tokens: 10 blocks loaded, 5 computed
    assert tier.stats.onloaded_blocks == 10 and tier.stats.failed_onloads == 0
    assert scheduler.onloading == {} and scheduler.kv_offload.num_loading == 0
    assert scheduler.num_onload_waits == 1


def test_an_abort_while_loading_frees_the_blocks_only_when_the_copies_end(tiny_llama_dir,
                                                                        reference):
    want, _ = reference
    first, revisits = _prompts()
    llm = _llm(tiny_llama_dir)
    tier = llm.llm_engine.core.executor.runner.host_tier
    assert _run(llm, first) == want[:4]
    opened = _gate(tier)
    s = _Stream(llm)
    scheduler = s.core.scheduler
    pool = scheduler.kv_cache_manager.pool
    s.add("revisit", revisits[0], GREEDY)
    s.step()
    blocks = list(scheduler.kv_cache_manager.req_blocks["revisit"])
    s.core.abort_requests(["revisit"])
    s.step()
    assert s.finished == {"revisit": FinishReason.ABORT}
    assert "revisit" not in scheduler.requests
    # The loader may still write them: not free, not reusable, its slots still held.
    assert all(b.ref_cnt == 1 for b in blocks) and "revisit" in scheduler.onloading
    assert scheduler.kv_offload.num_loading == 1
    opened.set()
    s.run_until(lambda: not scheduler.onloading)
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in blocks)
    assert pool.num_free_blocks == pool.num_blocks and scheduler.kv_offload.num_loading == 0
    assert _run(llm, revisits[1:]) == want[5:]


def test_a_failed_block_is_recomputed_from_there(tiny_llama_dir, reference):
    """Block 5 of the revisit's prefix fails its checksum: blocks 0-4 come from the tier,
    the rest is computed, the answer is the same, and the bad entry is forgotten."""
    want, _ = reference
    first, revisits = _prompts()
    llm = _llm(tiny_llama_dir)
    tier = llm.llm_engine.core.executor.runner.host_tier
    assert _run(llm, first) == want[:4]
    s = _Stream(llm)
    index = s.core.scheduler.kv_offload
    from pagoda.core.request import Request
    hashes = Request(EngineCoreRequest("x", revisits[0], GREEDY), BLOCK,
                     llm.llm_engine.core.config.cache.prefix_hash_seed, 256,
                     llm.llm_engine.core.config.cache.prefix_caching_hash_algo).block_hashes
    slot = index._entries[hashes[5]][0]
    for pair in tier.tensors:
        for t in pair:
            t[slot].view(torch.uint8).bitwise_xor_(0x5A)
    s.add("revisit", revisits[0], GREEDY)
    s.run_until(lambda: s.finished)
    assert s.tokens["revisit"] == want[4]
    assert s.cached["revisit"] == 5 * BLOCK
    assert tier.stats.failed_onloads == 1
    assert hashes[5] not in index and hashes[4] in index


@pytest.mark.parametrize("onload", ["async", "sync"])
def test_both_paths_give_the_reference(tiny_llama_dir, reference, onload):
    want, _ = reference
    first, revisits = _prompts()
    llm = _llm(tiny_llama_dir, onload)
    core = llm.llm_engine.core
    plans = []
    execute = core.executor.execute_model
    core.executor.execute_model = lambda plan: (plans.append(plan), execute(plan))[1]
    assert _run(llm, first + revisits) == want
    sync_ops = sum(len(p.kv_onloads) for p in plans)
    async_ops = sum(len(p.kv_async_onloads) for p in plans)
    assert (async_ops, sync_ops) == ((40, 0) if onload == "async" else (0, 40))  # 4 x 10 blocks
    # Asynchronous: no plan that starts copies also runs the request they are for.
    for plan in plans:
        assert not {op.req_id for op in plan.kv_async_onloads} & plan.num_scheduled_tokens.keys()


def test_the_flag_is_checked(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_offloading_onload"):
        _llm(tiny_llama_dir, "later")


def test_a_pp_group_agrees_on_async_onloads_that_failed_on_the_first_stage(tiny_llama_dir,
                                                                          reference, tmp_path):
    """Stage 0's disk records are gone, stage 1's (the output rank's) are intact: the
    report the scheduler gets is the group's, so every stage recomputes those blocks.
    Without the agreement stage 1 reports success and stage 0 runs on unwritten KV."""
    from pagoda.core.kv_disk_index import RECORD_OVERHEAD
    want, _ = reference
    first, revisits = _prompts()
    llm = LLM(tiny_llama_dir, dtype="float32", block_size=BLOCK, max_model_len=256,
              num_gpu_blocks_override=24, max_num_batched_tokens=64,
              distributed_executor_backend="mp", pipeline_parallel_size=2,
              kv_offloading_size=4 * TINY_BLOCK_BYTES / GIB,
              kv_offloading_disk_path=str(tmp_path),
              kv_offloading_disk_size=64 * (TINY_BLOCK_BYTES + RECORD_OVERHEAD) / GIB)
    try:
        assert _run(llm, first) == want[:4]
        for record in (tmp_path / "rank0").glob("epoch-*/*"):
            record.unlink()
        assert _run(llm, revisits) == want[4:]
        assert llm.llm_engine.core.scheduler.num_onload_waits == 4  # the async path
    finally:
        llm.llm_engine.core.shutdown()


def test_the_onload_wait_histogram_observes_each_wait_once():
    from prometheus_client import CollectorRegistry

    from pagoda.metrics.kv_offload_metrics import KVOffloadMetrics
    registry = CollectorRegistry()
    metrics = KVOffloadMetrics(["model_name"], ("m",), registry)
    metrics.record_waits(((1, 0.004), (2, 0.3)))
    metrics.record_waits(((1, 0.004), (2, 0.3), (3, 0.02)))  # the next step's snapshot
    name = "pagoda_kv_offload_onload_wait_seconds"
    assert registry.get_sample_value(f"{name}_count", {"model_name": "m"}) == 3
    assert registry.get_sample_value(f"{name}_sum", {"model_name": "m"}) == pytest.approx(0.324)
    assert registry.get_sample_value(f"{name}_bucket", {"model_name": "m", "le": "0.005"}) == 1


def test_a_worker_that_forgets_its_requests_still_reports_the_onloads(tiny_llama_dir,
                                                                     reference):
    """The gpu-worker forgets every request after a failed step (`runner.reset()`): the
    onloads in flight end, are reported as failed, and the waiting request recomputes
    (it would otherwise wait for a report that never comes)."""
    want, _ = reference
    first, revisits = _prompts()
    llm = _llm(tiny_llama_dir)
    runner = llm.llm_engine.core.executor.runner
    assert _run(llm, first) == want[:4]
    opened = _gate(runner.host_tier)
    s = _Stream(llm)
    s.add("revisit", revisits[0], GREEDY)
    s.step()
    assert "revisit" in s.core.scheduler.onloading
    threading.Timer(0.2, opened.set).start()
    runner.reset()  # waits for the copies
    s.run_until(lambda: s.finished)
    assert s.tokens["revisit"] == want[4] and s.cached["revisit"] == 0

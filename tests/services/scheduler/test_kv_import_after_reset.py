"""A decode replica whose own KV cache is reset (a failed step: EngineCore._recover sets
the worker's cache up again as zeros) while it imports a prompt's blocks never caches
them: the request computes its prompt here and answers exactly as a run without P/D;
a worker that wrote only part of the blocks is never committed either."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagoda import LLM, SamplingParams
from pagoda.core.block_hash import hash_request_tokens, request_keys
from pagoda.kv_transfer.params import KVTransferParams
from pagoda.messages import EngineCoreRequest
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as pb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services.common.kv_transfer_metrics import kv_transfer_metrics
from pagoda.services.scheduler.kv_consumer import KvConsumer

BS = 4
PROMPT = [1, 17, 23, 99, 5, 301, 8, 44, 12, 7, 7, 64, 65, 66]  # 3 full blocks and 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", block_size=BS, max_model_len=128)


class InlineEngine:
    def call_soon(self, fn) -> None:
        fn()


class ValidLease:
    async def ReleaseLease(self, request, timeout):
        return pb.ReleaseLeaseResponse(valid=True)


class Worker:
    """The decode replica's gpu-worker: writes the pulled blocks (here: nothing, as if
    the bytes had not landed yet), during which `during` runs, then answers having
    written `written` of them (None: all)."""

    def __init__(self, during=lambda: None, written=None) -> None:
        self.during, self.written = during, written

    async def FetchBlocks(self, request, timeout):
        self.during()
        n = len(request.local_block_ids) if self.written is None else self.written
        return pb.FetchBlocksResponse(num_blocks=n)


def reset_kv(core) -> None:
    """What EngineCore._recover does to the KV cache after a failed step."""
    core.scheduler.kv_cache_manager.pool.forget_contents()
    core.executor.initialize_kv_cache(core.scheduler.kv_cache_manager.pool.num_blocks)
    for listener in core.kv_reset_listeners:
        listener()


def pulled_then_generated(llm, worker: Worker) -> list[int]:
    """The prompt's blocks pulled by a KvConsumer over `llm`'s pool, then the request
    generated there (the decode replica's path: prepare, then submit)."""
    core = llm.llm_engine.core
    pool = core.scheduler.kv_cache_manager.pool
    seed = llm.llm_engine.config.cache.prefix_hash_seed
    hashes = hash_request_tokens(PROMPT, BS, seed, request_keys(None, None))
    info = spb.GetModelInfoResponse(instance_id="d", epoch="d-epoch", block_size=BS,
                                    prefix_hash_seed=seed)
    params = KVTransferParams(do_remote_prefill=True, remote_instance_id="p",
                              remote_scheduler_address="p:1", remote_worker_address="pw:1",
                              lease_id="lease", lease_expiry=time.time() + 60,
                              block_hashes=hashes, remote_block_ids=[0, 1, 2])
    request = EngineCoreRequest("r", list(PROMPT), GREEDY, kv_transfer_params=params)

    async def prepare() -> KvConsumer:
        consumer = KvConsumer(InlineEngine(), pool, info, "127.0.0.1:1", 5.0)
        consumer.worker = worker
        consumer._lease_stubs["p:1"] = ValidLease()
        core.kv_reset_listeners.append(consumer.on_kv_reset)  # as kv_role.build_hooks does
        try:
            await consumer.prepare(request)
        finally:
            core.kv_reset_listeners.remove(consumer.on_kv_reset)
        return consumer

    consumer = asyncio.run(prepare())
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    finally:
        consumer.finish("r")
    return list(out[0].outputs[0].token_ids)


def reference(llm) -> list[int]:
    """The colocated answer; the cache emptied after it (the blocks are to be pulled)."""
    want = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    assert llm.llm_engine.core.reset_prefix_cache()
    return list(want[0].outputs[0].token_ids)


def test_a_kv_reset_during_an_import_caches_nothing_and_the_answer_is_right(llm):
    want = reference(llm)
    core = llm.llm_engine.core
    failures = kv_transfer_metrics().failures.labels("kv_reset")
    before = failures._value.get()
    assert pulled_then_generated(llm, Worker(during=lambda: reset_kv(core))) == want
    assert failures._value.get() == before + 1
    # Nothing zeroed stayed cached under the prompt's hashes for later requests either.
    assert llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0] \
        .outputs[0].token_ids == want
    assert core.get_stats().kv_cache_usage == 0.0


def test_a_worker_that_wrote_part_of_the_blocks_is_not_committed(llm):
    want = reference(llm)
    core = llm.llm_engine.core
    failures = kv_transfer_metrics().failures.labels("error")
    before = failures._value.get()
    unwritten = Worker(  # the blocks hold zeros, not the prompt's KV
        during=lambda: core.executor.initialize_kv_cache(
            core.scheduler.kv_cache_manager.pool.num_blocks), written=1)
    assert pulled_then_generated(llm, unwritten) == want
    assert failures._value.get() == before + 1

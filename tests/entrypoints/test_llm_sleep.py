"""Sleep mode on the offline `LLM` (vLLM's `enable_sleep_mode`, `sleep`, `wake_up`,
`is_sleeping`): memory really given back, the same greedy output after waking up,
clear errors while asleep or busy."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.engine.worker_control import EngineSleeping
from pagoda.worker import cpu_allocator

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(300, 321)), [5, 17, 300, 42, 7]]
# 16-token blocks of this model's 3 layers x 2 KV heads x 16 dims: 2 KiB per layer per
# block, so each layer's key or value tensor is 40 MiB: above the allocator's mmap
# threshold (pagoda.worker.cpu_allocator), so freeing it returns it to the kernel.
NUM_BLOCKS = 20480


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def leave_free_memory_in_the_heap() -> None:
    """What a long-lived process looks like: with the engine's malloc thresholds
    (pagoda.worker.cpu_allocator.tune), 400 MiB of 4 MiB buffers freed stay in the heap,
    so the KV cache is carved out of it instead of its own mappings. Sleeping must give
    it back all the same (the full suite found this: in isolation it passed)."""
    cpu_allocator.tune()
    buffers = [torch.ones(1024 * 1024) for _ in range(100)]
    del buffers


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    leave_free_memory_in_the_heap()
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=16, max_model_len=256,
               num_gpu_blocks_override=NUM_BLOCKS, enable_sleep_mode=True)


@pytest.fixture(autouse=True)
def awake_after_each_test(llm):
    """One test's failure must not leave the next one a sleeping engine."""
    yield
    if llm.is_sleeping():
        llm.wake_up()
    if llm.llm_engine.core.sleep.weights_need_loading:  # a level-2 sleep left undefined weights
        llm.collective_rpc("reload_weights")


def greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_level_1_frees_kv_cache_and_weights_and_wakes_up_to_the_same_output(llm):
    before = greedy(llm)
    [weights] = llm.collective_rpc("weight_bytes")
    [kv] = llm.collective_rpc("kv_cache_bytes")
    assert kv == 3 * 2 * NUM_BLOCKS * 16 * 2 * 16 * 4 and weights > 0
    rss = rss_bytes()
    llm.sleep(level=1)
    assert llm.is_sleeping()
    # No device storage left: the weights sit in their host copy, the KV cache is gone.
    assert llm.collective_rpc("weight_bytes") == [0]
    assert llm.collective_rpc("kv_cache_bytes") == [0]
    assert rss - rss_bytes() > 0.8 * kv, "freeing the KV cache did not lower the RSS"
    with pytest.raises(EngineSleeping, match="sleeping"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert llm.collective_rpc("weight_bytes") == [weights]
    assert llm.collective_rpc("kv_cache_bytes") == [kv]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == before
    # The KV contents were lost: nothing cached before sleeping may be served after.
    assert [o.num_cached_tokens for o in outs] == [0, 0]


def test_level_2_discards_weights_until_they_are_reloaded(llm):
    before = greedy(llm)
    llm.sleep(level=2)
    assert llm.collective_rpc("weight_bytes") == [0]
    llm.wake_up(tags=["weights"])  # memory back, contents undefined
    assert llm.is_sleeping()  # the KV cache still sleeps
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    with pytest.raises(EngineSleeping, match="reload_weights"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.collective_rpc("reload_weights")
    assert greedy(llm) == before


def test_sleep_is_refused_while_requests_are_in_flight(llm):
    engine = llm.llm_engine
    request_id = engine.add_request(None, [1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="in flight"):
        llm.sleep()
    assert not llm.is_sleeping()
    engine.abort_request([request_id])
    while engine.has_unfinished_requests():
        engine.step()
    llm.sleep()
    with pytest.raises(RuntimeError, match="already sleeping"):
        llm.sleep(level=2)
    llm.wake_up()


def test_bad_level_and_tags_are_refused(llm):
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["everything"])
    assert not llm.is_sleeping()


def test_sleep_needs_enable_sleep_mode(tiny_llama_dir):
    plain = LLM(model=tiny_llama_dir, dtype="float32", block_size=4, max_model_len=64,
                num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        plain.sleep()
    assert not plain.is_sleeping()


def test_collective_rpc_and_apply_model_on_one_rank(llm):
    assert llm.collective_rpc("is_sleeping") == [False]
    assert llm.collective_rpc(lambda worker, k: worker.rank + k, args=(5,)) == [5]
    assert llm.apply_model(lambda model: model.arch.num_hidden_layers) == [3]
    with pytest.raises(ValueError, match="Unknown worker method"):
        llm.collective_rpc("__init__")

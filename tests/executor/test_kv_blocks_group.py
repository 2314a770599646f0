"""A worker group moves KV blocks whole (every layer and KV head): `export_kv_blocks`
gathers each rank's share at rank 0, `import_kv_blocks` gives each rank its share of
whole blocks. What a TP=2 x PP=2 group exports is what one rank computed for the same
prompt, and whole blocks written into it read back exactly; a bad block id fails the
call, not the group."""

from __future__ import annotations

import pytest
import torch
from group_cases import engine_kwargs, greedy_params

from pagoda import LLM

PROMPT = list(range(300, 317))  # 4 full blocks of 4 tokens, then one more token


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    one = LLM(model=tiny_llama_dir, **engine_kwargs())
    group = LLM(model=tiny_llama_dir, **engine_kwargs(
        tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp"))
    for llm in (one, group):
        llm.generate([PROMPT], greedy_params(), use_tqdm=False)
    yield one.llm_engine.core.executor, group.llm_engine.core.executor
    for llm in (one, group):
        llm.llm_engine.core.shutdown()


def test_a_group_exports_what_one_rank_computed(engines):
    one, group = engines
    ids = [0, 1, 2, 3]  # the prompt's full blocks (the same allocation in both engines)
    mine, theirs = one.export_kv_blocks(ids), group.export_kv_blocks(ids)
    assert theirs.shape == mine.shape == one.kv_cache_geometry()[0].dims(4)
    assert torch.allclose(theirs, mine, atol=1e-4)
    assert theirs.abs().sum() > 0


def test_whole_blocks_imported_into_a_group_read_back_exactly(engines):
    one, group = engines
    shape, num_blocks = group.kv_cache_geometry()
    blocks = torch.randn(shape.dims(3), dtype=shape.dtype)
    targets = [num_blocks - 1, num_blocks - 3, num_blocks - 2]
    group.import_kv_blocks(targets, blocks)
    assert torch.equal(group.export_kv_blocks(targets), blocks)
    with pytest.raises(ValueError, match="no KV block"):
        group.export_kv_blocks([num_blocks])
    with pytest.raises(ValueError, match="expected 2 KV blocks"):
        group.import_kv_blocks(targets[:2], blocks)
    assert group.check_health()  # the group survived both refusals
    assert torch.equal(group.export_kv_blocks(targets[:1]), blocks[:1])

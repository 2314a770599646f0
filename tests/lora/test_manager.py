"""Device slots (--max-loras) and the host cache (--max-cpu-loras): LRU, and adapters
a step needs are never evicted."""

from __future__ import annotations

import pytest
import torch

from pagoda.core.block_hash import hash_request_tokens, request_keys
from pagoda.lora.config import LoRAConfig
from pagoda.lora.manager import LoRAModelManager
from pagoda.lora.request import LoRARequest
from pagoda.model.loader import load_arch_config, load_model


@pytest.fixture
def manager(tiny_llama_dir):
    model = load_model(tiny_llama_dir, load_arch_config(tiny_llama_dir), torch.float32,
                       torch.device("cpu"))
    return LoRAModelManager(model, LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2),
                            torch.device("cpu"), torch.float32)


def test_lru_slots_and_host_cache(manager, adapters):
    r1, r2, r3 = (LoRARequest(f"a{i}", i + 1, adapters[i]) for i in range(3))
    manager.prepare_step([(r1, 2), (None, 1), (r2, 1)])
    assert manager.context.batch.token_slots.tolist() == [0, 0, -1, 1]
    manager.prepare_step([(r2, 1)])  # touch r2: r1 becomes least recently used
    manager.prepare_step([(r3, 1)])
    assert set(manager.slots) == {2, 3} and manager.slots[3] == 0  # r1's slot reused
    assert list(manager.cpu_cache) == [2, 3]  # max_cpu_loras=2: r1 left host memory
    layer = manager.layers["model.layers.0.self_attn.o_proj"]
    assert not layer.a_stack[0].any()  # adapter 3 (q/v only) left o_proj's slot zero
    with pytest.raises(RuntimeError, match="max_loras"):
        manager.prepare_step([(r1, 1), (r2, 1), (r3, 1)])
    manager.prepare_step([(None, 3)])
    assert manager.context.batch is None
    assert manager.remove_adapter(2) and 2 not in manager.slots


def test_adapter_name_keys_the_block_hash():
    tokens = list(range(8))
    base = hash_request_tokens(tokens, 4, "seed", request_keys(None))
    one = hash_request_tokens(tokens, 4, "seed", request_keys(None, "one"))
    two = hash_request_tokens(tokens, 4, "seed", request_keys(None, "two"))
    salted = hash_request_tokens(tokens, 4, "seed", request_keys("one", None))
    assert len({base[0], one[0], two[0], salted[0]}) == 4
    assert one == hash_request_tokens(tokens, 4, "seed", request_keys(None, "one"))

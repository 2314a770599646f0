"""Prefix caching for Granite-4.0-H (hybrid: Mamba2 + attention) on state checkpoints.

A hit on the attention blocks alone would skip the Mamba layers' pass over the prefix;
each request's prefill saves its recurrent state at its last block boundary before its
last token (pagoda.core.state_checkpoints) and a later hit ends at a block with such a
state, restored into the request's slot. Greedy tokens and logprobs stay equal to
transformers' (which has no cache) when: a conversation's next turn extends the last
one; more prompts than checkpoint slots go round (LRU eviction) through a KV pool small
enough to evict blocks (whose checkpoints go with them); identical prompts arrive in
one step (both compute: a step's saves are planned after its admissions, so no
request of the step can restore one; the next step's request does).
"""

from __future__ import annotations

import pytest

from arch_parity import (ENGINE, assert_same, hf_greedy, pagoda_greedy, random_prompts,
                         save_tiny_checkpoint)
from pagoda import LLM
from test_granitemoehybrid import granite_hybrid_config

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory, smollm2_tokenizer) -> str:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("granite_hybrid"),
                                granite_hybrid_config(position_embedding_type=None),
                                smollm2_tokenizer)


def _hits(llm) -> int:
    return llm.llm_engine.core.scheduler.kv_cache_manager.prefix_stats.hits


def test_the_next_turn_starts_from_the_last_turns_state(hybrid_path):
    first = random_prompts([30], seed=3)[0]
    llm = LLM(model=hybrid_path, **ENGINE)
    [(answer, _)], _ = pagoda_greedy(llm, [first], MAX_TOKENS)
    second = first + answer + random_prompts([9], seed=4)[0]
    before = _hits(llm)
    ours, outputs = pagoda_greedy(llm, [second], MAX_TOKENS)
    # The first turn saved the state after its 7th 4-token block (28 of 30 tokens).
    assert outputs[0].num_cached_tokens == 28 and _hits(llm) - before == 28
    assert_same(ours, hf_greedy(hybrid_path, [second], MAX_TOKENS))


def test_checkpoints_evicted_with_their_blocks_and_by_lru(hybrid_path):
    """2 checkpoint slots (max_num_seqs 2) for 6 prompts, a 40-block pool: each round
    evicts checkpoints and blocks; every answer is still transformers'."""
    prompts = random_prompts([13, 22, 9, 30, 17], seed=5)
    want = hf_greedy(hybrid_path, prompts, MAX_TOKENS)
    llm = LLM(model=hybrid_path, **{**ENGINE, "max_num_seqs": 2,
                                    "num_gpu_blocks_override": 40})
    checkpoints = llm.llm_engine.core.scheduler.kv_cache_manager.state_checkpoints
    assert checkpoints.num_slots == 2
    for order in (prompts, prompts[::-1], prompts):
        ours, _ = pagoda_greedy(llm, order, MAX_TOKENS)
        assert_same(ours, want if order is prompts else want[::-1])
    assert _hits(llm) > 0


def test_identical_prompts_in_one_step(hybrid_path):
    prompt = random_prompts([21], seed=6)[0]
    llm = LLM(model=hybrid_path, **{**ENGINE, "max_num_batched_tokens": 64})
    ours, outputs = pagoda_greedy(llm, [prompt, prompt], MAX_TOKENS)
    want = hf_greedy(hybrid_path, [prompt], MAX_TOKENS)
    assert_same(ours, want * 2)
    assert [o.num_cached_tokens for o in outputs] == [0, 0]  # nothing saved yet
    again, outputs = pagoda_greedy(llm, [prompt], MAX_TOKENS)
    assert_same(again, want)
    assert outputs[0].num_cached_tokens == 20

"""Mistral against transformers: sliding-window attention in every layer, and the KV
blocks that fall out of the window released while a request runs."""

from __future__ import annotations

from transformers import MistralConfig

from arch_parity import (VOCAB_SIZE, assert_matches_transformers, hf_greedy, pagoda_greedy,
                         assert_same, random_prompts, save_tiny_checkpoint)
from pagoda import LLM
from pagoda.model.loader import load_arch_config

WINDOW = 8


def mistral_dir(path, tokenizer) -> str:
    config = MistralConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, max_position_embeddings=256, sliding_window=WINDOW)
    return save_tiny_checkpoint(path, config, tokenizer)


def test_mistral_sliding_window_greedy_and_logprobs_match_transformers(tmp_path,
                                                                      smollm2_tokenizer):
    path = mistral_dir(tmp_path, smollm2_tokenizer)
    arch = load_arch_config(path)
    assert arch.sliding_window.window == WINDOW and arch.kv_cache_sliding_window == WINDOW
    # Prompts up to 5x the window, chunked by 16 tokens, then decoded past it.
    llm = assert_matches_transformers(path, random_prompts([5, 23, 41]), 20)
    assert llm.llm_engine.config.cache.sliding_window == WINDOW


def test_long_generation_runs_in_a_kv_cache_smaller_than_its_sequence(tmp_path,
                                                                      smollm2_tokenizer):
    # 12 blocks of 4 hold 48 tokens; the request grows to 40 + 60 = 100. Released
    # blocks keep it within (W - 1 + 16) / 4 + 2 blocks, so it never waits or is preempted.
    path = mistral_dir(tmp_path, smollm2_tokenizer)
    prompts = random_prompts([40], seed=3)[:1]
    reference = hf_greedy(path, prompts, 60)
    llm = LLM(model=path, dtype="float32", block_size=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=12)
    ours, _ = pagoda_greedy(llm, prompts, 60)
    assert_same(ours, reference)
    scheduler = llm.llm_engine.core.scheduler
    assert scheduler.num_preemptions == 0
    pool = scheduler.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    # And again, now partly from the blocks the first run left cached.
    ours, _ = pagoda_greedy(llm, prompts, 60)
    assert_same(ours, reference)

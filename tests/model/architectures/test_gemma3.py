"""Gemma 3 (text) against transformers: q/k norms, five local layers per global one, a
local RoPE base for the sliding layers and linear scaling for the global ones."""

from __future__ import annotations

from transformers import Gemma3TextConfig

from arch_parity import (VOCAB_SIZE, assert_matches_transformers, random_prompts,
                         save_tiny_checkpoint)
from pagoda.config import ModelArchConfig, SlidingWindowConfig
from pagoda.model.architectures.gemma3 import (Gemma3ForCausalLM, Gemma3Settings,
                                               gemma3_arch_config)
from pagoda.model.loader import load_arch_config
from pagoda.model.registry import MODEL_REGISTRY


def test_gemma3_greedy_and_logprobs_match_transformers(tmp_path, smollm2_tokenizer):
    config = Gemma3TextConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, max_position_embeddings=256, sliding_window=8,
                              query_pre_attn_scalar=24, final_logit_softcapping=3.0,
                              rope_scaling={"rope_type": "linear", "factor": 8.0})
    config.architectures = ["Gemma3ForCausalLM"]
    path = save_tiny_checkpoint(tmp_path, config, smollm2_tokenizer)
    arch = load_arch_config(path)
    assert MODEL_REGISTRY.resolve(arch.architecture).model_cls is Gemma3ForCausalLM
    assert [arch.layer_sliding_window(i) for i in range(7)] == [8] * 5 + [None, 8]
    assert (arch.rope_theta, arch.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    settings = arch.family_settings
    assert (settings.local_rope_theta, settings.local_rope_scaling) == (1e4, None)
    assert_matches_transformers(path, random_prompts([5, 23, 41]), 16)


def test_gemma3_reads_the_older_config_spelling():
    # google/gemma-3-1b-it: top-level rope_theta, rope_local_base_freq, a pattern.
    arch = ModelArchConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=4,
                           num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                           sliding_window=SlidingWindowConfig(512))
    hf_config = {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": None,
                 "sliding_window_pattern": 2, "query_pre_attn_scalar": 256}
    arch = gemma3_arch_config(hf_config, arch)
    settings = Gemma3Settings.from_hf_config(hf_config, arch)
    assert [arch.layer_sliding_window(i) for i in range(4)] == [512, None, 512, None]
    assert (arch.rope_theta, arch.rope_scaling, settings.local_rope_theta) == (1e6, None, 1e4)
    assert settings.final_logit_softcapping is None and settings.attn_logit_softcapping is None

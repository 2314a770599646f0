"""Phi-3 against transformers: fused qkv/gate-up checkpoint tensors, a sliding window in
every layer (Phi-3-mini-4k), longrope with its short and long factors, partial rotary."""

from __future__ import annotations

import pytest
from transformers import Phi3Config

from arch_parity import (VOCAB_SIZE, assert_matches_transformers, random_prompts,
                         save_tiny_checkpoint)
from pagoda.model.architectures.phi3 import Phi3ForCausalLM
from pagoda.model.loader import load_arch_config
from pagoda.model.registry import MODEL_REGISTRY

ORIGINAL_MAX = 32


def longrope(partial_rotary_factor: float) -> dict:
    half = int(16 * partial_rotary_factor) // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.5 + 0.7 * i for i in range(half)], "rope_theta": 10000.0,
            "partial_rotary_factor": partial_rotary_factor}


def phi3_dir(path, tokenizer, **overrides) -> str:
    config = Phi3Config(**{**dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128,
                                  pad_token_id=0, bos_token_id=1), **overrides})
    return save_tiny_checkpoint(path, config, tokenizer)


def test_phi3_fused_weights_and_sliding_window_match_transformers(tmp_path, smollm2_tokenizer):
    path = phi3_dir(tmp_path, smollm2_tokenizer, sliding_window=12)
    arch = load_arch_config(path)
    assert MODEL_REGISTRY.resolve(arch.architecture).model_cls is Phi3ForCausalLM
    assert arch.kv_cache_sliding_window == 12
    assert_matches_transformers(path, random_prompts([5, 23, 41]), 16)


@pytest.mark.parametrize("max_model_len,lengths", [(ORIGINAL_MAX, [7, 15]), (128, [34, 45])],
                         ids=["short-factors", "long-factors"])
def test_phi3_longrope_matches_transformers(tmp_path, smollm2_tokenizer, max_model_len, lengths):
    # A context that fits the pretraining length runs the short factors, in both; past it
    # we run the long ones everywhere, as transformers does for a prompt that long.
    path = phi3_dir(tmp_path, smollm2_tokenizer, original_max_position_embeddings=ORIGINAL_MAX,
                    rope_parameters=longrope(0.75), sliding_window=None)
    arch = load_arch_config(path)
    assert arch.rope_scaling["rope_type"] == "longrope"
    assert arch.family_settings.partial_rotary_factor == 0.75
    assert arch.rope_scaling["original_max_position_embeddings"] == ORIGINAL_MAX
    assert_matches_transformers(path, random_prompts(lengths), 8, max_model_len=max_model_len)

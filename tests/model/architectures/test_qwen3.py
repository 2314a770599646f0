"""Qwen3 against transformers: q/k RMSNorm per head, with and without yarn RoPE scaling."""

from __future__ import annotations

import pytest
from transformers import Qwen3Config

from arch_parity import (VOCAB_SIZE, assert_matches_transformers, random_prompts,
                         save_tiny_checkpoint)
from pagoda.model.architectures.qwen3 import Qwen3ForCausalLM
from pagoda.model.loader import load_arch_config
from pagoda.model.registry import MODEL_REGISTRY

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def qwen3_config(**overrides) -> Qwen3Config:
    values = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen3Config(**{**values, **overrides})


@pytest.mark.parametrize("rope", [None, YARN], ids=["plain", "yarn"])
def test_qwen3_greedy_and_logprobs_match_transformers(tmp_path, smollm2_tokenizer, rope):
    config = qwen3_config(rope_parameters={"rope_theta": 1e6, **(rope or {})})
    path = save_tiny_checkpoint(tmp_path, config, smollm2_tokenizer)
    arch = load_arch_config(path)
    assert MODEL_REGISTRY.resolve(arch.architecture).model_cls is Qwen3ForCausalLM
    assert (arch.rope_scaling or {}).get("rope_type") == (rope or {}).get("rope_type")
    # Prompts past the yarn pretraining length (32), decoded further.
    assert_matches_transformers(path, random_prompts([7, 30, 45]), 16)

"""Mixtral against transformers: the router's softmax top-2, always renormalised, and every
expert's SwiGLU (experts batched per step, `moe.py`)."""

from __future__ import annotations

import torch
from transformers import MixtralConfig

from arch_parity import (VOCAB_SIZE, assert_matches_transformers, random_prompts,
                         save_tiny_checkpoint)
from pagoda.model.architectures.mixtral import MixtralForCausalLM
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.registry import MODEL_REGISTRY


def test_mixtral_greedy_and_logprobs_match_transformers(tmp_path, smollm2_tokenizer):
    config = MixtralConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=256, tie_word_embeddings=False)
    path = save_tiny_checkpoint(tmp_path, config, smollm2_tokenizer)
    arch = load_arch_config(path)
    assert MODEL_REGISTRY.resolve(arch.architecture).model_cls is MixtralForCausalLM
    assert (arch.moe.num_experts, arch.moe.num_experts_per_tok, arch.moe.norm_topk_prob,
            arch.moe.intermediate_size) == (4, 2, True, 32)
    experts = load_model(path, arch, torch.float32).model.layers[0].mlp.experts
    # Every expert's gate and up rows stacked, and its down projection: all held here.
    assert experts.w13_weight.shape == (4, 64, 64) and experts.w2_weight.shape == (4, 64, 32)
    assert_matches_transformers(path, random_prompts([7, 30, 45]), 16)

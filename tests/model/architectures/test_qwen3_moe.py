"""Qwen3-MoE against transformers: q/k norms, a dense layer among the MoE layers
(`mlp_only_layers`), and both `norm_topk_prob` settings."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig

from arch_parity import (VOCAB_SIZE, assert_matches_transformers, random_prompts,
                         save_tiny_checkpoint)
from pagoda.model.decoder_layer import GatedMLP
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.moe import SparseMoeBlock


def qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    values = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                  mlp_only_layers=[1], max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen3MoeConfig(**{**values, **overrides})


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_greedy_and_logprobs_match_transformers(tmp_path, smollm2_tokenizer,
                                                          norm_topk_prob):
    path = save_tiny_checkpoint(tmp_path, qwen3_moe_config(norm_topk_prob=norm_topk_prob),
                                smollm2_tokenizer)
    arch = load_arch_config(path)
    moe = arch.moe
    assert (moe.num_experts, moe.intermediate_size, moe.dense_mlp_layers,
            moe.norm_topk_prob) == (4, 32, (1,), norm_topk_prob)
    model = load_model(path, arch, torch.float32)
    assert [type(layer.mlp) for layer in model.model.layers] == [SparseMoeBlock, GatedMLP,
                                                                 SparseMoeBlock]
    assert_matches_transformers(path, random_prompts([7, 30, 45]), 16)


def test_decoder_sparse_step_makes_the_other_layers_dense(tmp_path, smollm2_tokenizer):
    config = qwen3_moe_config(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2)
    path = save_tiny_checkpoint(tmp_path, config, smollm2_tokenizer)
    assert load_arch_config(path).moe.dense_mlp_layers == (0, 2)

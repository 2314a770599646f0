"""Qwen2-MoE against transformers: q/k/v biases, the gated shared expert, a dense layer
among the MoE layers (`mlp_only_layers`), both `norm_topk_prob` settings, and
`decoder_sparse_step`."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2MoeConfig

from arch_parity import (VOCAB_SIZE, assert_matches_transformers, random_prompts,
                         save_tiny_checkpoint)
from pagoda.model.arch_spec import family_settings
from pagoda.model.architectures.qwen2_moe import Qwen2MoeSettings
from pagoda.model.decoder_layer import GatedMLP
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.moe_shared_expert import SharedExpertMoeBlock


def qwen2_moe_config(**overrides) -> Qwen2MoeConfig:
    values = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                  max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen2MoeConfig(**{**values, **overrides})


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen2_moe_greedy_and_logprobs_match_transformers(tmp_path, smollm2_tokenizer,
                                                          norm_topk_prob):
    path = save_tiny_checkpoint(tmp_path, qwen2_moe_config(norm_topk_prob=norm_topk_prob),
                                smollm2_tokenizer)
    arch = load_arch_config(path)
    moe = arch.moe
    assert (moe.num_experts, moe.intermediate_size, moe.dense_mlp_layers,
            moe.norm_topk_prob) == (4, 32, (1,), norm_topk_prob)
    assert arch.attention_bias
    assert family_settings(arch, Qwen2MoeSettings).shared_expert_intermediate_size == 48
    model = load_model(path, arch, torch.float32)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [SharedExpertMoeBlock, GatedMLP,
                                                     SharedExpertMoeBlock]
    assert layers[0].self_attn.qkv_proj.bias is not None
    assert_matches_transformers(path, random_prompts([7, 30, 45]), 16)


def test_the_shared_expert_changes_the_output(tmp_path, smollm2_tokenizer):
    """Without its shared expert the model would not match: zeroing the gate's weight
    halves the shared branch (sigmoid(0) = 1/2), and the logits move."""
    path = save_tiny_checkpoint(tmp_path, qwen2_moe_config(), smollm2_tokenizer)
    arch = load_arch_config(path)
    model = load_model(path, arch, torch.float32)
    x = torch.randn(5, 64)
    block = model.model.layers[0].mlp
    with torch.no_grad():
        before = block(x)
        block.shared_expert_gate.weight.zero_()
        after = block(x)
    assert not torch.allclose(before, after, atol=1e-3)


def test_decoder_sparse_step_and_qkv_bias_from_config(tmp_path, smollm2_tokenizer):
    config = qwen2_moe_config(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2,
                              qkv_bias=False)
    path = save_tiny_checkpoint(tmp_path, config, smollm2_tokenizer)
    arch = load_arch_config(path)
    assert arch.moe.dense_mlp_layers == (0, 2)
    assert not arch.attention_bias
    assert_matches_transformers(path, random_prompts([9, 20]), 8)

"""Qwen3-MoE against transformers on tiny random checkpoints: q/k norms, a dense layer
among MoE layers (`mlp_only_layers`), and both `norm_topk_prob` settings."""

from __future__ import annotations

import pytest
import torch
from moe_cases import prefill_metadata, save_tiny_qwen3_moe

from pagoda.model.decoder_layer import GatedMLP
from pagoda.model.kv_cache import allocate_kv_caches
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.moe import SparseMoeBlock


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_prefill_logits_match_transformers(tmp_path, norm_topk_prob):
    from transformers import AutoModelForCausalLM

    path = save_tiny_qwen3_moe(tmp_path, norm_topk_prob=norm_topk_prob)
    arch = load_arch_config(path)
    assert (arch.num_experts, arch.moe_intermediate_size, arch.dense_mlp_layers,
            arch.norm_topk_prob) == (4, 32, (1,), norm_topk_prob)
    model = load_model(path, arch, torch.float32)
    assert [type(layer.mlp) for layer in model.model.layers] == [SparseMoeBlock, GatedMLP,
                                                                 SparseMoeBlock]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 49152, (23,), generator=torch.Generator().manual_seed(4))
    kv = allocate_kv_caches(arch, 8, 4, torch.float32, "cpu")
    with torch.inference_mode():
        ours = model.compute_logits(model(tokens, torch.arange(23), kv, prefill_metadata(23)))
        expected = hf(tokens[None]).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_decoder_sparse_step_makes_the_other_layers_dense(tmp_path):
    path = save_tiny_qwen3_moe(tmp_path, num_hidden_layers=4, mlp_only_layers=[],
                               decoder_sparse_step=2)
    assert load_arch_config(path).dense_mlp_layers == (0, 2)

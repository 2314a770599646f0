"""DeepSeek-V3 split over tensor-parallel ranks (threads of this process on gloo): MLA
by query head with the latent cache replicated, experts split or (expert parallelism)
placed whole, shared experts split like a dense MLP. The logits of a prefill and a
decode equal the whole model's. (End to end through `pagoda.LLM` against transformers:
tests/model/architectures/test_deepseek_parallel.py.)"""

from __future__ import annotations

import pytest
import torch
from model_steps import two_steps


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=2, initializer_range=0.2,
        num_nextn_predict_layers=0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("deepseek_v3")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("tp,expert_parallel", [(2, False), (4, False), (2, True)])
def test_sharded_deepseek_logits_equal_the_whole_model(ranks, deepseek_dir, tp,
                                                       expert_parallel):
    from pagoda.distributed.parallel_state import ParallelContext
    from pagoda.model.kv_cache import allocate_kv_caches
    from pagoda.model.loader import load_arch_config, load_model

    arch = load_arch_config(deepseek_dir)
    steps = two_steps(200)

    def run(parallel):
        model = load_model(deepseek_dir, arch, torch.float32, "cpu", parallel)
        caches = allocate_kv_caches(arch, 8, 4, torch.float32, "cpu", parallel)
        with torch.inference_mode():
            logits = [model.compute_logits(model(ids, pos, caches, md)) for ids, pos, md in steps]
        return logits, model.model.layers[0].self_attn.num_heads, caches[0][0].shape

    def rank_body(h, rank):
        p = h.parallel
        return run(ParallelContext(p.tp_size, rank, tp_group=p.tp_group,
                                   enable_expert_parallel=expert_parallel))

    whole, _, whole_cache = run(None)
    sharded, local_heads, cache_shape = ranks(tp, rank_body)[0]
    assert local_heads == 4 // tp
    assert cache_shape == whole_cache  # the latent is not split: every rank holds it whole
    for got, want in zip(sharded, whole, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

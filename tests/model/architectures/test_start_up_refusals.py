"""Models a loader meets and cannot serve are refused at start-up (when the engine
config is built, before any weight loads), each with a message naming the architecture
or feature and the nearest supported one; and a checkpoint tensor no layer consumes is
refused by name in every family of issue 30, never loaded wrong silently."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_deepseek import v2_config, v3_config
from test_gpt_oss import gpt_oss_config
from test_granitemoehybrid import granite_hybrid_config
from test_qwen2_moe import qwen2_moe_config
from transformers import LlamaConfig

from arch_parity import VOCAB_SIZE, save_tiny_checkpoint
from pagoda.engine.arg_utils import EngineArgs
from pagoda.model.loader import load_arch_config, load_model


def tiny_llama(path, tokenizer, **config_json) -> str:
    """A dense tiny Llama; `config_json` entries overwrite its config.json's."""
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    save_tiny_checkpoint(path, config, tokenizer)
    file = path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **config_json}))
    return str(path)


def engine_config(path: str, **args):
    return EngineArgs(model=path, dtype="float32", **args).create_engine_config()


def test_an_unknown_architecture_names_the_nearest_supported(tmp_path, smollm2_tokenizer):
    path = tiny_llama(tmp_path, smollm2_tokenizer, architectures=["DeepseekV4ForCausalLM"])
    with pytest.raises(ValueError, match=r"\['DeepseekV4ForCausalLM'\] are not supported "
                                         r"\(the nearest supported: DeepseekV3ForCausalLM\)"):
        engine_config(path)


def test_mxfp4_on_another_architecture_is_refused(tmp_path, smollm2_tokenizer):
    """MXFP4 is gpt-oss's expert format: on a Llama checkpoint it is refused when the
    config is read, naming both architectures (before, only the first linear layer
    built in the worker refused it)."""
    path = tiny_llama(tmp_path, smollm2_tokenizer,
                      quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match=r"supported for gpt-oss \(GptOssForCausalLM\) only.*"
                                         "not for LlamaForCausalLM"):
        engine_config(path)


def test_mtp_speculation_without_mtp_heads_is_refused(tmp_path, smollm2_tokenizer):
    path = tiny_llama(tmp_path, smollm2_tokenizer)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MTP heads.*"
                                         r'Use \{"method": "ngram"\}'):
        engine_config(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_mtp_speculation_with_mtp_heads_names_them(tmp_path, smollm2_tokenizer):
    """A DeepSeek-V3 checkpoint with an MTP layer: its heads exist but are not run as
    drafts (they are named as ignored on load), so the method is still refused."""
    path = save_tiny_checkpoint(tmp_path, v3_config(num_nextn_predict_layers=1),
                                smollm2_tokenizer)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM's checkpoint has 1 MTP "
                                         "layer\\(s\\), but Pagoda does not run MTP heads"):
        engine_config(path, speculative_config={"method": "deepseek_mtp",
                                                "num_speculative_tokens": 1})


def test_expert_parallel_on_a_dense_model_is_refused(tmp_path, smollm2_tokenizer):
    path = tiny_llama(tmp_path, smollm2_tokenizer)
    with pytest.raises(ValueError, match="--enable-expert-parallel: LlamaForCausalLM is a "
                                         "dense model.*MoE architectures: Mixtral"):
        engine_config(path, enable_expert_parallel=True)


FAMILIES = {"deepseek-v2": v2_config, "deepseek-v3": v3_config, "gpt-oss": gpt_oss_config,
            "granite-4.0-h": granite_hybrid_config, "qwen2-moe": qwen2_moe_config}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tensor_no_layer_consumes_is_refused_by_name(tmp_path, smollm2_tokenizer, family):
    path = save_tiny_checkpoint(tmp_path, FAMILIES[family](), smollm2_tokenizer)
    arch = load_arch_config(path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="Unexpected weight 'model.layers.0.mlp.extra_proj."
                                         f"weight' in checkpoint: the {arch.architecture}"):
        load_model(path, arch, torch.float32)

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


def test_mtp_on_another_architecture_is_refused(tmp_path, smollm2_tokenizer):
    """MTP layers in a checkpoint Pagoda runs no MTP drafts for (here a Llama whose
    config.json claims one, and DeepSeek-V2): refused naming DeepSeek-V3."""
    path = tiny_llama(tmp_path / "llama", smollm2_tokenizer, num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match=r"runs DeepSeek-V3's MTP layers \(DeepseekV3ForCausalLM\) "
                                         "only; LlamaForCausalLM's checkpoint has 1 MTP layer"):
        engine_config(path, speculative_config={"method": "mtp"})
    path = save_tiny_checkpoint(tmp_path / "v2", v2_config(), smollm2_tokenizer)
    file = tmp_path / "v2" / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match="only; DeepseekV2ForCausalLM's checkpoint"):
        engine_config(path, speculative_config={"method": "deepseek_mtp"})


@pytest.mark.parametrize("args,message", [
    ({"tensor_parallel_size": 2}, r"not supported with tensor parallelism \(--tensor-parallel"),
    ({"enable_lora": True}, "not supported with --enable-lora"),
    ({"speculative_config": {"method": "mtp", "model": "x"}}, '"model" names a draft model'),
    ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}},
     r"num_speculative_tokens \(3\) must be divisible by the checkpoint's 2 MTP layer"),
])
def test_mtp_with_what_it_was_not_verified_with_is_refused(tmp_path, smollm2_tokenizer, args,
                                                           message):
    path = save_tiny_checkpoint(tmp_path, v3_config(num_nextn_predict_layers=2),
                                smollm2_tokenizer)
    args = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}, **args}
    with pytest.raises(ValueError, match=message):
        engine_config(path, **args)


def test_mtp_config_on_deepseek_v3(tmp_path, smollm2_tokenizer):
    """Accepted: num_speculative_tokens defaults to the MTP layers (vLLM's n_predict), the
    target's vocabulary bounds the worker's drafts, the model is built with its MTP layer;
    on a P/D replica it is refused by name."""
    from pagoda.spec_decode.config import refuse_mtp_with_kv_transfer

    path = save_tiny_checkpoint(tmp_path, v3_config(num_nextn_predict_layers=2),
                                smollm2_tokenizer)
    config = engine_config(path, speculative_config={"method": "deepseek_mtp"})
    spec = config.scheduler.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.vocab_size) == ("mtp", 2, VOCAB_SIZE)
    assert config.arch.family_settings.mtp_drafts
    refuse_mtp_with_kv_transfer(spec, None)
    refuse_mtp_with_kv_transfer(spec, "kv_both")  # colocated: served (the matrix row)
    with pytest.raises(ValueError, match="not supported with KV transfer .*kv_consumer"):
        refuse_mtp_with_kv_transfer(spec, "kv_consumer")


def test_every_mtp_tensor_is_consumed_or_named(tmp_path, smollm2_tokenizer, caplog):
    """Under MTP drafts the first MTP layer's tensors are read (one it lacks is missing
    by name, one it does not know is refused by name), the second layer's are named as
    ignored."""
    from pagoda.model.architectures.deepseek_v2 import with_mtp_drafts

    path = save_tiny_checkpoint(tmp_path, v3_config(num_nextn_predict_layers=2),
                                smollm2_tokenizer)
    tensors = load_file(f"{path}/model.safetensors")
    mtp = {}
    for index in (3, 4):
        mtp.update({name.replace("model.layers.2.", f"model.layers.{index}."): t.clone()
                    for name, t in tensors.items() if name.startswith("model.layers.2.")})
        for part in ("enorm", "hnorm", "shared_head.norm"):
            mtp[f"model.layers.{index}.{part}.weight"] = torch.ones(64)
        mtp[f"model.layers.{index}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, f"{path}/model.safetensors", metadata={"format": "pt"})
    arch = with_mtp_drafts(load_arch_config(path))
    with caplog.at_level("INFO"):
        model = load_model(path, arch, torch.float32)
    layer4 = sum(name.startswith("model.layers.4.") for name in mtp)
    assert (f"Ignoring {layer4} tensors of the checkpoint's MTP layers after the first"
            in caplog.text)
    assert "has no model.layers.3.embed_tokens.weight: it uses model.embed_tokens" in caplog.text
    assert torch.equal(model.mtp_layer.shared_head.head.weight, tensors["lm_head.weight"])
    bad = {**tensors, **mtp, "model.layers.3.extra.weight": torch.zeros(4)}
    save_file(bad, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="Unexpected weight 'model.layers.3.extra.weight'"):
        load_model(path, arch, torch.float32)
    del mtp["model.layers.3.eh_proj.weight"]
    save_file({**tensors, **mtp}, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 1 weight.*model.layers.3.eh_proj.weight"):
        load_model(path, arch, torch.float32)


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

"""Quantized checkpoints (AWQ, GPTQ, FP8, compressed-tensors FP8) built by hand from the tiny
Llama: their weights stay quantized in memory, and the model computes what the dense model
of their dequantized weights computes.

Tolerance: on the CPU each layer dequantizes its weight in fp32 exactly as the reference
checkpoint was built, so the logits agree to fp32 rounding (atol 1e-5) and greedy
tokens are equal.
"""

from __future__ import annotations

import logging

import pytest
import torch
from moe_cases import prefill_metadata, save_tiny_mixtral
from quant_cases import FORMATS, save_quantized

from pagoda import LLM, SamplingParams
from pagoda.engine.arg_utils import EngineArgs
from pagoda.model.kv_cache import allocate_kv_caches
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.quantization import resolve_quantization

STORED = {  # what a quantized linear layer holds after loading
    "awq": {"qweight": torch.int32, "scales": torch.float32, "zeros": torch.uint8},
    "gptq": {"qweight": torch.int32, "scales": torch.float32, "zeros": torch.uint8},
    "gptq-act-order": {"qweight": torch.int32, "scales": torch.float32, "zeros": torch.uint8,
                       "g_idx": torch.int32},
    "fp8-tensor": {"weight": torch.float8_e4m3fn, "weight_scale": torch.float32},
    "fp8-block": {"weight": torch.float8_e4m3fn, "weight_scale_inv": torch.float32},
    "ct-channel": {"weight": torch.float8_e4m3fn, "weight_scale": torch.float32},
    "ct-tensor": {"weight": torch.float8_e4m3fn, "weight_scale": torch.float32},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_llama_dir):
    """fmt -> (quantized dir, reference dir), built on first use."""
    built: dict[str, tuple[str, str]] = {}

    def get(fmt: str) -> tuple[str, str]:
        if fmt not in built:
            root = tmp_path_factory.mktemp(fmt)
            save_quantized(tiny_llama_dir, fmt, str(root / "q"), str(root / "ref"))
            built[fmt] = (str(root / "q"), str(root / "ref"))
        return built[fmt]

    return get


def logits(model_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    arch = load_arch_config(model_dir)
    model = load_model(model_dir, arch, torch.float32)
    kv = allocate_kv_caches(arch, 8, 4, torch.float32, "cpu")
    with torch.inference_mode():
        hidden = model(tokens, torch.arange(len(tokens)), kv, prefill_metadata(len(tokens)))
        return model.compute_logits(hidden)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_weights_stay_quantized_and_logits_match_the_dequantized_model(checkpoints, fmt, caplog):
    quantized, reference = checkpoints(fmt)
    arch = load_arch_config(quantized)
    assert arch.quantization_config["quant_method"] == FORMATS[fmt]["quant_method"]
    with caplog.at_level(logging.INFO, logger="pagoda.model.loader"):
        model = load_model(quantized, arch, torch.float32)
    assert any("Model weights take" in r.message and "GiB" in r.message for r in caplog.records)
    qkv = model.model.layers[0].self_attn.qkv_proj
    stored = {name: p.dtype for name, p in qkv.named_parameters()}
    assert stored == STORED[fmt]
    dense = load_model(reference, load_arch_config(reference), torch.float32)
    assert _linear_bytes(model) * 3 < _linear_bytes(dense)  # int4: 1/8 + scales; fp8: 1/4
    tokens = torch.randint(0, 49152, (19,), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(quantized, tokens), logits(reference, tokens),
                               atol=1e-5, rtol=1e-5)


def _linear_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "proj" in n)


@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order", "fp8-block"])
def test_greedy_tokens_through_llm_equal_the_dequantized_model(checkpoints, fmt):
    quantized, reference = checkpoints(fmt)
    prompts = [{"prompt_token_ids": [5, 17, 300, 42, 7]}, {"prompt_token_ids": list(range(40))}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = []
    for path in (quantized, reference):
        llm = LLM(model=path, dtype="float32", block_size=4, max_model_len=128,
                  num_gpu_blocks_override=64)
        try:
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                        use_tqdm=False)])
        finally:
            llm.llm_engine.core.shutdown()
    assert tokens[0] == tokens[1]


def test_online_fp8_quantizes_an_unquantized_model_per_channel(tiny_llama_dir):
    arch = load_arch_config(tiny_llama_dir)
    config = resolve_quantization("fp8", arch.quantization_config)
    assert config == {"quant_method": "fp8", "is_checkpoint_fp8_serialized": False}
    import dataclasses

    model = load_model(tiny_llama_dir, dataclasses.replace(arch, quantization_config=config),
                       torch.float32)
    layer = model.model.layers[1].mlp.down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (64, 1)
    # Each output row is scaled so its largest weight is fp8's largest value, 448.
    from safetensors.torch import load_file

    dense = load_file(f"{tiny_llama_dir}/model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    scale = dense.abs().amax(dim=1, keepdim=True) / 448
    torch.testing.assert_close(layer.weight_scale, scale)
    torch.testing.assert_close(layer.weight.float() * layer.weight_scale, dense,
                               rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits


def test_quantization_flag_rules():
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    assert resolve_quantization(None, None) is None
    assert resolve_quantization(None, awq) == awq  # auto-detected
    assert resolve_quantization("awq", awq) == awq
    with pytest.raises(ValueError, match=r"model config \(awq\) does not match the "
                                         r"quantization method specified in the `quantization` "
                                         r"argument \(gptq\)"):
        resolve_quantization("gptq", awq)
    with pytest.raises(ValueError, match="Unknown quantization method 'int3'; supported: fp8, "
                                         "awq, gptq, compressed-tensors"):
        resolve_quantization("int3", None)
    with pytest.raises(ValueError, match="--quantization awq needs a checkpoint quantized"):
        resolve_quantization("awq", None)
    with pytest.raises(ValueError, match="only 4-bit GPTQ"):
        resolve_quantization(None, {"quant_method": "gptq", "bits": 8})
    with pytest.raises(ValueError, match="'bitsandbytes'.*is not supported"):
        resolve_quantization(None, {"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="only FP8 weights"):
        resolve_quantization(None, {"quant_method": "compressed-tensors", "config_groups": {
            "g": {"weights": {"num_bits": 4, "type": "int"}, "format": "pack-quantized"}}})


def test_engine_args_resolve_quantization_and_refuse_fp8_kv_cache_on_cpu(checkpoints):
    quantized, _ = checkpoints("awq")
    config = EngineArgs(model=quantized, device="cpu").create_engine_config()
    assert config.arch.quantization_config["quant_method"] == "awq"
    with pytest.raises(ValueError, match="does not match"):
        EngineArgs(model=quantized, device="cpu", quantization="fp8").create_engine_config()
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 needs a CUDA device"):
        EngineArgs(model=quantized, device="cpu", kv_cache_dtype="fp8").create_engine_config()


def test_a_mixture_of_experts_model_refuses_online_fp8(tmp_path, smollm2_tokenizer):
    """Quantized MoE checkpoints load (tests/model/test_quantized_moe.py); quantizing the
    experts of an unquantized one while loading does not."""
    path = save_tiny_mixtral(tmp_path, smollm2_tokenizer)
    arch = load_arch_config(path)
    import dataclasses

    arch = dataclasses.replace(arch, quantization_config=resolve_quantization("fp8", None))
    with pytest.raises(ValueError, match=r"--quantization fp8 on an unquantized checkpoint "
                                         r"\(online FP8\) is not supported for the "
                                         "mixture-of-experts layers of MixtralForCausalLM"):
        load_model(path, arch, torch.float32)

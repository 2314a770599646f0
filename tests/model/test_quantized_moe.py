"""Quantized MoE checkpoints (FP8, compressed-tensors FP8, AWQ, GPTQ experts) built by hand
from tiny Qwen3-MoE and Qwen2-MoE models (`quant_cases`: every expert projection, the
shared expert and the attention quantized in the format's exact on-disk form): the
experts are dequantized on load and the model computes what the dense model of the
dequantized weights computes, logits to fp32 rounding and greedy tokens equal to
transformers' on that dense model. What cannot run (online FP8 of experts) is refused
naming the method, the architecture and what to serve instead.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from moe_cases import hf_greedy, prefill_metadata, save_tiny_qwen2_moe, save_tiny_qwen3_moe
from quant_cases import FORMATS, save_quantized
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from pagoda.engine.arg_utils import EngineArgs
from pagoda.model.kv_cache import allocate_kv_caches
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.quantization import resolve_quantization

SAVERS = {"qwen3_moe": save_tiny_qwen3_moe, "qwen2_moe": save_tiny_qwen2_moe}
# The tensors one quantized expert projection is stored as, per format.
EXPERT_TENSORS = {"awq": {"qweight", "qzeros", "scales"},
                  "gptq": {"qweight", "qzeros", "scales", "g_idx"},
                  "gptq-act-order": {"qweight", "qzeros", "scales", "g_idx"},
                  "fp8-tensor": {"weight", "weight_scale", "input_scale"},
                  "fp8-block": {"weight", "weight_scale_inv"},
                  "ct-channel": {"weight", "weight_scale"},
                  "ct-tensor": {"weight", "weight_scale", "input_scale"}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer):
    """(model, fmt) -> (quantized dir, dequantized reference dir), built on first use."""
    built: dict[tuple[str, str], tuple[str, str]] = {}

    def get(model: str, fmt: str) -> tuple[str, str]:
        if (model, fmt) not in built:
            root = tmp_path_factory.mktemp(f"{model}-{fmt}")
            src = SAVERS[model](root / "src", smollm2_tokenizer)
            save_quantized(src, fmt, str(root / "q"), str(root / "ref"))
            built[model, fmt] = (str(root / "q"), str(root / "ref"))
        return built[model, fmt]

    return get


def logits(model_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    arch = load_arch_config(model_dir)
    model = load_model(model_dir, arch, torch.float32)
    kv = allocate_kv_caches(arch, 16, 4, torch.float32, "cpu")
    with torch.inference_mode():
        hidden = model(tokens, torch.arange(len(tokens)), kv, prefill_metadata(len(tokens)))
        return model.compute_logits(hidden)


# Every format on Qwen3-MoE; on Qwen2-MoE (its shared expert quantized as a dense MLP) one
# FP8 and one int4 format: the expert path is the same code.
CASES = [("qwen3_moe", fmt) for fmt in FORMATS] + [("qwen2_moe", "fp8-tensor"),
                                                     ("qwen2_moe", "gptq")]


@pytest.mark.parametrize("model,fmt", CASES)
def test_quantized_experts_compute_what_the_dequantized_model_computes(checkpoints, model, fmt):
    quantized, reference = checkpoints(model, fmt)
    stored = load_file(os.path.join(quantized, "model.safetensors"))
    prefix = "model.layers.0.mlp.experts.3.down_proj."
    assert {n.removeprefix(prefix) for n in stored if n.startswith(prefix)} == \
        EXPERT_TENSORS[fmt]  # the experts really are stored quantized
    tokens = torch.tensor([5, 17, 300, 42, 7, 8, 9, 10, 11, 12, 300, 301, 302])
    ours, want = logits(quantized, tokens), logits(reference, tokens)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    # The quantization error is visible: the original weights give other logits.
    original = os.path.join(os.path.dirname(quantized), "src")
    assert not torch.allclose(logits(original, tokens), want, atol=1e-3)


PROMPTS = [[5, 17, 300, 42, 7, 8, 9, 10, 11, 12], list(range(300, 318)), [9] * 5]


@pytest.mark.parametrize("model,fmt", [("qwen2_moe", "fp8-block"),
                                       ("qwen3_moe", "gptq-act-order"),
                                       ("qwen2_moe", "awq")])
def test_greedy_tokens_equal_transformers_on_the_dequantized_model(checkpoints, model, fmt):
    quantized, reference = checkpoints(model, fmt)
    llm = LLM(model=quantized, dtype="float32", block_size=4, max_model_len=128,
              num_gpu_blocks_override=64, max_num_batched_tokens=16)
    assert llm.llm_engine.config.arch.quantization_config["quant_method"] == \
        FORMATS[fmt]["quant_method"]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == \
        [hf_greedy(reference, p, 8) for p in PROMPTS]


def test_experts_the_checkpoint_leaves_unquantized_load_plain(checkpoints, tmp_path):
    """compressed-tensors' `ignore` naming the experts: they are stored in full precision
    (the attention and shared expert stay FP8), and read as such."""
    quantized, reference = checkpoints("qwen2_moe", "ct-channel")
    tensors = load_file(os.path.join(quantized, "model.safetensors"))
    dense = load_file(os.path.join(reference, "model.safetensors"))
    mixed = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    mixed.update({n: t for n, t in dense.items() if ".mlp.experts." in n})
    os.makedirs(tmp_path / "mixed")
    for f in os.listdir(quantized):
        if not f.endswith(".safetensors"):
            with open(os.path.join(quantized, f), "rb") as src, \
                    open(tmp_path / "mixed" / f, "wb") as dst:
                dst.write(src.read())
    save_file(mixed, str(tmp_path / "mixed" / "model.safetensors"))
    config = json.loads((tmp_path / "mixed" / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*mlp\\.experts\\..*"]
    (tmp_path / "mixed" / "config.json").write_text(json.dumps(config))
    tokens = torch.tensor([5, 17, 300, 42, 7, 8, 9])
    torch.testing.assert_close(logits(str(tmp_path / "mixed"), tokens),
                               logits(reference, tokens), atol=1e-5, rtol=1e-5)


def test_online_fp8_of_experts_is_refused_by_name(tmp_path, smollm2_tokenizer):
    path = save_tiny_qwen3_moe(tmp_path, smollm2_tokenizer)
    arch = load_arch_config(path)
    arch = dataclasses.replace(arch, quantization_config=resolve_quantization("fp8", None))
    message = (r"--quantization fp8 on an unquantized checkpoint \(online FP8\) is not "
               r"supported for the mixture-of-experts layers of Qwen3MoeForCausalLM: .*"
               r"FP8-serialized checkpoints")
    with pytest.raises(ValueError, match=message):
        load_model(path, arch, torch.float32)
    with pytest.raises(ValueError, match=message):  # at start-up, before any worker
        EngineArgs(model=path, device="cpu", quantization="fp8").create_engine_config()

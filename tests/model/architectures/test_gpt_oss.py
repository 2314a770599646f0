"""gpt-oss against transformers: sink attention, alternating sliding/full layers whose
window (8) is shorter than the prompts, yarn RoPE, the biased router with a softmax
over its top k, biased experts with the clamped SwiGLU (a limit low enough to clamp),
and an MXFP4 checkpoint whose experts are packed here, against the same weights
dequantized."""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig

from arch_parity import (VOCAB_SIZE, assert_matches_transformers, assert_same, hf_greedy,
                         pagoda_greedy, random_prompts, save_tiny_checkpoint)
from pagoda import LLM
from pagoda.model import ops
from pagoda.model.decoder_layer import PagedSelfAttention
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.quantization.mxfp4 import FP4_VALUES, SCALE_BIAS, dequantize_mxfp4
from pagoda.tokenizer.harmony import CONTROL_TOKENS

WINDOW = 8


def gpt_oss_config(**overrides) -> GptOssConfig:
    values = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                  sliding_window=WINDOW, max_position_embeddings=256, swiglu_limit=1.5,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                   "original_max_position_embeddings": 64})
    return GptOssConfig(**{**values, **overrides})


def save_gpt_oss(path, tokenizer, sink_scale: float = 2.0) -> str:
    """A tiny random gpt-oss whose sinks (N(0, sink_scale)) and expert biases (zero in
    HF's init) are visibly non-zero."""
    save_tiny_checkpoint(path, gpt_oss_config(), tokenizer)
    randomize_sinks_and_biases(path, sink_scale)
    return str(path)


def harmony_tokenizer(tokenizer):
    """A copy of `tokenizer` (SmolLM2's) with gpt-oss's harmony control tokens added, each
    one special token (ids from 49152 up), as gpt-oss's own tokenizer has them: chats
    are rendered in the harmony format (pagoda.tokenizer.harmony) with those ids."""
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(CONTROL_TOKENS)})
    return tokenizer


def save_gpt_oss_chat(path, tokenizer, **overrides) -> str:
    """The tiny gpt-oss with `harmony_tokenizer(tokenizer)` and a vocabulary that holds
    all of it, for chats (text prompts and harmony control tokens)."""
    tokenizer = harmony_tokenizer(tokenizer)
    config = gpt_oss_config(**{"vocab_size": len(tokenizer), "max_position_embeddings": 1024,
                               **overrides})
    save_tiny_checkpoint(path, config, tokenizer)
    randomize_sinks_and_biases(path)
    return str(path)


def randomize_sinks_and_biases(path, sink_scale: float = 2.0) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith("self_attn.sinks"):
            tensors[name] = sink_scale * torch.randn(t.shape, generator=g)
        elif name.endswith(("gate_up_proj_bias", "down_proj_bias")):
            tensors[name] = 0.5 * torch.randn(t.shape, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})


def test_gpt_oss_greedy_and_logprobs_match_transformers(tmp_path, smollm2_tokenizer):
    path = save_gpt_oss(tmp_path, smollm2_tokenizer)
    arch = load_arch_config(path)
    assert [arch.layer_sliding_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert (arch.moe.num_experts, arch.moe.intermediate_size, arch.attention_bias) == (4, 32, True)
    assert arch.rope_scaling["rope_type"] == "yarn"
    model = load_model(path, arch, torch.float32)
    sinks = model.model.layers[0].self_attn.sinks
    assert sinks.abs().min() > 0.05  # the sinks take part in the comparison
    assert_matches_transformers(path, random_prompts([7, 30, 45]), 16)


def test_a_prompt_prefilled_alone_matches_transformers(tmp_path, smollm2_tokenizer):
    """One request at a time (how a server mostly sees them): a step holding a lone
    prefill. Its sink attention's output came back as a strided view the output
    projection could not take (found serving gpt-oss); now it is the batched answer."""
    path = save_gpt_oss(tmp_path, smollm2_tokenizer)
    llm = LLM(model=path, dtype="float32", block_size=16, num_gpu_blocks_override=64)
    for prompt in random_prompts([20, 3]):
        assert_same(pagoda_greedy(llm, [prompt], 6)[0], hf_greedy(path, [prompt], 6))


def test_zeroed_sinks_change_the_logits(tmp_path, smollm2_tokenizer):
    """The sinks are read: the same weights with zero sinks give other logprobs."""
    path = save_gpt_oss(tmp_path / "random", smollm2_tokenizer)
    zero = save_gpt_oss(tmp_path / "zero", smollm2_tokenizer, sink_scale=0.0)
    prompts = random_prompts([20])
    runs = []
    for p in (path, zero):
        llm = LLM(model=p, dtype="float32", block_size=4, num_gpu_blocks_override=64)
        runs.append(pagoda_greedy(llm, prompts, 4)[0])
    assert max(abs(a - b) for (_, la), (_, lb) in zip(*runs) for a, b in zip(la, lb)) > 1e-3


def test_sinks_build_where_the_triton_kernels_run(tmp_path, smollm2_tokenizer, monkeypatch):
    """The Triton attention takes sinks (tests/kernels/test_attention_sinks.py, and the
    whole tiny model through the kernels in test_sink_and_mla_models_through_triton.py):
    a layer with them builds there, sinks held as a parameter of this rank's heads."""
    arch = load_arch_config(save_gpt_oss(tmp_path, smollm2_tokenizer))
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    layer = PagedSelfAttention(arch, torch.float32, True, True, sinks=True)
    assert tuple(layer.sinks.shape) == (arch.num_attention_heads,)


# ---------------------------------------------------------------- MXFP4

def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., cols] (cols % 32 == 0) -> (blocks uint8 [..., cols/32, 16], scales uint8
    [..., cols/32]): each 32-run scaled by 2^e so its largest |value| fits FP4's 6, each
    value rounded to the nearest FP4 code."""
    runs = w.reshape(*w.shape[:-1], -1, 32).float()
    amax = runs.abs().amax(-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = runs / torch.exp2(exponent)[..., None]
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)


def test_dequantize_mxfp4_reads_nibbles_low_first_and_scales():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x2F  # low nibble 15 (-6.0) first, then 2 (1.0)
    scales = torch.tensor([SCALE_BIAS + 1], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (32,)
    assert out[:3].tolist() == [-12.0, 2.0, 0.0]


def test_mxfp4_checkpoint_matches_its_dequantized_weights(tmp_path, smollm2_tokenizer):
    """Pack the experts of a tiny gpt-oss to MXFP4 (transformers' names and [E, out, in]
    order, quantization_config mxfp4); write beside it the unquantized checkpoint of
    exactly the weights MXFP4 encodes. Pagoda on the MXFP4 files must equal
    transformers on the dequantized ones."""
    reference = save_gpt_oss(tmp_path / "dequantized", smollm2_tokenizer)
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    tensors = load_file(os.path.join(reference, "model.safetensors"))
    packed = {}
    for name, t in list(tensors.items()):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = pack_mxfp4(t.transpose(1, 2))  # HF [E, in, out] -> [E, out, in]
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            tensors[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        else:
            packed[name] = t
    save_file(tensors, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
    save_file(packed, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(reference):
        if name != "model.safetensors":
            with open(os.path.join(reference, name), "rb") as src:
                (quantized / name).write_bytes(src.read())
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config))

    prompts = random_prompts([7, 30])
    want = hf_greedy(reference, prompts, 8)
    llm = LLM(model=str(quantized), dtype="float32", block_size=4, num_gpu_blocks_override=128)
    got, _ = pagoda_greedy(llm, prompts, 8)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                   atol=1e-4, rtol=0)


def test_mxfp4_is_refused_on_another_architecture(tiny_llama_dir, tmp_path):
    arch = load_arch_config(tiny_llama_dir)
    arch = dataclasses.replace(arch, quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match="MXFP4.*gpt-oss"):
        load_model(tiny_llama_dir, arch, torch.float32)


@pytest.mark.extended  # two worker processes: make test-extended
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_equals_transformers(tmp_path, smollm2_tokenizer, expert_parallel):
    """TP=2: each rank holds 2 of the 4 heads and their sinks, and half of every expert's
    intermediate rows (or, with expert parallelism, 2 whole experts); the down biases
    are added once."""
    path = save_gpt_oss(tmp_path, smollm2_tokenizer)
    prompts = random_prompts([7, 30])
    want = hf_greedy(path, prompts, 8)
    llm = LLM(model=path, dtype="float32", block_size=4, num_gpu_blocks_override=128,
              max_num_batched_tokens=16, tensor_parallel_size=2,
              distributed_executor_backend="mp", enable_expert_parallel=expert_parallel)
    try:
        got, _ = pagoda_greedy(llm, prompts, 8)
    finally:
        llm.llm_engine.core.shutdown()
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                   atol=1e-4, rtol=0)

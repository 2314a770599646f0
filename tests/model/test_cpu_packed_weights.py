"""bf16 CPU linear layers multiply from oneDNN-prepacked weights, bit-equal to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.model import cpu_packed_weights, prepack_cpu_weights
from pagoda.model.kv_cache import allocate_kv_caches

pytestmark = pytest.mark.skipif(not cpu_packed_weights.available(),
                                reason="no native bf16 on this CPU, or torch without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 32, 300])
def test_packed_product_equals_f_linear_bit_for_bit(rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    packed = cpu_packed_weights.pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)[:, ::2]  # a strided view
    assert torch.equal(cpu_packed_weights.linear(x, packed), F.linear(x, weight))
    assert torch.equal(cpu_packed_weights.linear(x, packed, bias), F.linear(x, weight, bias))
    batched = x.reshape(1, rows, 64)
    assert torch.equal(cpu_packed_weights.linear(batched, packed), F.linear(batched, weight))
    # A row's result does not depend on the other rows (batch invariance kept).
    assert torch.equal(cpu_packed_weights.linear(x[:1], packed),
                       cpu_packed_weights.linear(x, packed)[:1])


def test_plain_weights_keep_f_linear():
    weight = torch.randn(8, 4)
    x = torch.randn(2, 4)
    assert torch.equal(cpu_packed_weights.linear(x, weight), F.linear(x, weight))


def forward_logits(model, steps, paged_sequences) -> list[torch.Tensor]:
    """Logits of a prefill of two sequences, then three decode steps of both."""
    seqs = paged_sequences(num_blocks=16, block_size=4)
    g = torch.Generator().manual_seed(0)
    seqs.add("a", torch.randint(0, 49152, (24,), generator=g).tolist())
    seqs.add("b", torch.randint(0, 49152, (24,), generator=g).tolist())
    caches = allocate_kv_caches(model.arch, 16, 4, torch.bfloat16, "cpu")
    out = []
    with torch.inference_mode():
        for schedule in steps:
            input_ids, positions, md = seqs.step(schedule)
            out.append(model.compute_logits(model(input_ids, positions, caches, md)))
    return out


def test_a_packed_model_gives_the_same_logits(tiny_llama_dir, paged_sequences):
    from pagoda.model.loader import load_arch_config, load_model

    arch = load_arch_config(tiny_llama_dir)
    plain = load_model(tiny_llama_dir, arch, torch.bfloat16)
    packed = load_model(tiny_llama_dir, arch, torch.bfloat16)
    table = packed.model.embed_tokens.weight.detach().clone()
    # 3 layers x (qkv, o, gate_up, down) and the tied head's copy.
    assert prepack_cpu_weights.pack_linear_weights(packed) == 13
    layer = packed.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.is_mkldnn and layer.mlp.down_proj.weight.is_mkldnn
    # The tied embedding still looks tokens up in its plain table; its copy is packed.
    head = packed.model.embed_tokens
    assert torch.equal(head.weight, table) and head.packed_weight.is_mkldnn
    steps = [[("a", 20), ("b", 13)], [("a", 1), ("b", 7)], [("a", 1), ("b", 1)]]
    for want, got in zip(forward_logits(plain, steps, paged_sequences),
                         forward_logits(packed, steps, paged_sequences)):
        assert torch.equal(want, got)
    assert prepack_cpu_weights.pack_linear_weights(packed) == 0  # packing twice is a no-op


def test_an_untied_head_is_packed_in_place():
    from pagoda.model.parallel_layers import ParallelLMHead

    model = torch.nn.Module()
    model.lm_head = ParallelLMHead(512, 64, torch.bfloat16)
    model.lm_head.weight.copy_(torch.randn(512, 64))
    hidden = torch.randn(5, 64, dtype=torch.bfloat16)
    want = model.lm_head.compute_logits(hidden)
    assert prepack_cpu_weights.pack_linear_weights(model) == 1
    assert model.lm_head.weight.is_mkldnn  # no plain copy left behind
    assert "packed_weight" not in model.lm_head._buffers
    assert torch.equal(model.lm_head.compute_logits(hidden), want)


def test_gguf_int4_layers_pack_their_large_step_weight():
    from pagoda.model.quantization import gguf_int4
    from pagoda.model.quantization.base import UnquantizedLinearMethod

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(96, 256, dtype=torch.bfloat16),
                                      requires_grad=False)
    layer.quant_method = UnquantizedLinearMethod()
    plain = layer.weight.detach().clone()
    gguf_int4.pack_small_batch_int4(layer, None, gguf_int4.MAX_INT4_ROWS_PACKED)
    assert prepack_cpu_weights.pack_linear_weights(layer) == 1
    method = layer.quant_method
    big = torch.randn(gguf_int4.MAX_INT4_ROWS_PACKED + 1, 256, dtype=torch.bfloat16)
    assert torch.equal(method.apply(layer, big), F.linear(big, plain))
    small = torch.randn(gguf_int4.MAX_INT4_ROWS_PACKED, 256, dtype=torch.bfloat16)
    if gguf_int4.gemv_enabled():  # Pagoda's skinny GEMV (kernels/cpu/csrc/gemv.h)
        from pagoda.kernels import cpu as cpu_kernels

        int4 = cpu_kernels.int4_gemv(small, layer.gemv_int4_weight, layer.gemv_int4_scales)
    else:
        int4 = torch._weight_int4pack_mm_for_cpu(small, layer.int4_weight,
                                                 gguf_int4.GROUP_SIZE, layer.int4_scales_zeros)
    assert torch.equal(method.apply(layer, small), int4)


def test_where_it_applies(monkeypatch):
    cpu = torch.device("cpu")
    assert cpu_packed_weights.applies(cpu, torch.bfloat16)
    assert not cpu_packed_weights.applies(cpu, torch.float32)
    assert not cpu_packed_weights.applies(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setenv("PAGODA_CPU_PACKED_WEIGHTS", "0")
    assert not cpu_packed_weights.applies(cpu, torch.bfloat16)


def test_the_default_engine_packs_its_weights():
    from pagoda import LLM, SamplingParams

    llm = LLM(max_model_len=256)
    model = llm.llm_engine.core.executor.runner.model
    assert model.model.layers[0].mlp.gate_up_proj.weight.is_mkldnn
    assert model.model.embed_tokens.packed_weight.is_mkldnn
    # Six rows: past the 4-bit kernel's steps, so the prepacked bf16 product runs.
    outputs = llm.generate(["Count: 1, 2, 3,"] * 6,
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
    assert all(o.outputs[0].text.startswith(" 4, 5, 6") for o in outputs)

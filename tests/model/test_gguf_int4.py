"""GGUF 4-bit layers multiplied from packed int4 in small CPU steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.model.quantization import gguf_int4
from pagoda.model.quantization.base import UnquantizedLinearMethod

pytestmark = pytest.mark.skipif(not gguf_int4.available(), reason="torch without int4 CPU mm")


def q4_1_weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights as llama.cpp's Q4_1 stores them: per block of 32, d * q + m with the
    block's min on q = 0 and its max on q = 15. Returns (q, weights in fp32)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.02 + 0.001
    m = -torch.rand(n, k // 32, 1, generator=g) * 0.1
    return q.reshape(n, k), (d * q + m).reshape(n, k)


def dequantize(q: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    scale = scales_zeros[..., 0].t().float().repeat_interleave(32, dim=1)
    zero = scales_zeros[..., 1].t().float().repeat_interleave(32, dim=1)
    return (q.float() - 8) * scale + zero


def test_q4_1_blocks_come_back_exactly():
    q, weights = q4_1_weights(64, 128)
    got_q, scales_zeros = gguf_int4.quantize_groups(weights.to(torch.bfloat16))
    assert torch.equal(got_q, q.to(torch.int32))  # every level recovered through bf16
    # Only bf16's rounding of each block's scale and zero remains.
    assert (dequantize(got_q, scales_zeros) - weights).abs().max() < 2e-3


class Layer(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method = UnquantizedLinearMethod()


def test_small_steps_use_int4_and_large_steps_the_unchanged_bf16_weight():
    _, weights = q4_1_weights(96, 256)
    layer = Layer(weights.to(torch.bfloat16))
    before = layer.weight.detach().clone()
    assert gguf_int4.pack_small_batch_int4(layer, head_form=None) == 1
    assert torch.equal(layer.weight, before)  # packing keeps the bf16 weight intact
    method = layer.quant_method
    x = torch.randn(3, 2 * 256, dtype=torch.bfloat16)[:, ::2]  # a strided view
    reference = x.float() @ dequantize(*gguf_int4.quantize_groups(layer.weight)).t()
    small = method.apply(layer, x)
    assert (small.float() - reference).abs().max() < 0.05 * reference.abs().max()
    big = torch.randn(gguf_int4.MAX_INT4_ROWS + 1, 256, dtype=torch.bfloat16)
    assert torch.equal(method.apply(layer, big), F.linear(big, before))


def test_default_model_answers_from_its_4bit_weights():
    from pagoda import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["Count: 1, 2, 3,", "What is the capital of France?"]
    # bfloat16 named: --dtype auto is float32 on CPUs without native bf16.
    packed = LLM(max_model_len=256, dtype="bfloat16")
    assert packed.llm_engine.config.gguf_int4
    texts = [o.outputs[0].text for o in packed.generate(prompts, params, use_tqdm=False)]
    assert texts[0].startswith(" 4, 5, 6") and "Paris" in texts[1]
    for o in packed.generate(prompts, SamplingParams(temperature=0, max_tokens=4, logprobs=1),
                             use_tqdm=False):
        assert all(torch.isfinite(torch.tensor(v.logprob)) for d in o.outputs[0].logprobs
                   for v in d.values())


def test_where_it_applies(tiny_llama_dir):
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.model.loader import cpu_has_fast_bf16, default_model_path

    def resolved(**kwargs) -> bool:
        return EngineArgs(device="cpu", **kwargs).create_engine_config().gguf_int4

    gguf = default_model_path()
    assert resolved(model=gguf, dtype="bfloat16") is True
    # --dtype auto: bf16, and so the int4 steps, only where the CPU has native bf16
    assert resolved(model=gguf) is cpu_has_fast_bf16()
    assert resolved(model=gguf, dtype="float32") is False
    assert resolved(model=gguf, batch_invariant=True) is False
    assert resolved(model=gguf, gguf_int4=False) is False
    assert resolved(model=str(tiny_llama_dir)) is False
    with pytest.raises(ValueError, match="not a GGUF file whose layers are Q4_0 or Q4_1"):
        resolved(model=str(tiny_llama_dir), gguf_int4=True)
    with pytest.raises(ValueError, match="bfloat16 only"):
        resolved(model=gguf, dtype="float32", gguf_int4=True)


def test_a_q8_0_head_multiplies_from_per_row_int8_in_small_steps():
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(torch.randn(512, 64, dtype=torch.bfloat16),
                                     requires_grad=False)
    gguf_int4.attach_int8(head, head.weight)
    hidden = torch.randn(3, 64, dtype=torch.bfloat16)
    reference = F.linear(hidden, head.weight).float()
    logits = gguf_int4.int4_logits(head, hidden).float()
    assert (logits - reference).abs().max() < 0.02 * reference.abs().max()
    big = torch.randn(gguf_int4.MAX_INT4_ROWS + 1, 64, dtype=torch.bfloat16)
    assert gguf_int4.int4_logits(head, big) is None  # the caller's bf16 product


@pytest.mark.parametrize("gemv", ["1", "0"])
def test_the_gemv_switch_picks_the_packed_form_and_kernel(monkeypatch, gemv):
    """PAGODA_CPU_GEMV (read at packing) gives a layer the skinny GEMV's layout and an int8
    head its GEMV, or torch's int4pack and `_weight_int8pack_mm`; small steps multiply
    with the one the layer holds."""
    from pagoda.kernels import cpu as cpu_kernels

    monkeypatch.setenv("PAGODA_CPU_GEMV", gemv)
    on = gemv == "1" and cpu_kernels.available()
    layer = Layer(torch.randn(48, 96, dtype=torch.bfloat16))
    gguf_int4.pack_small_batch_int4(layer, head_form=None)
    assert ("gemv_int4_weight" in layer._buffers) is on
    assert ("int4_weight" in layer._buffers) is not on
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    q, scales_zeros = gguf_int4.quantize_groups(layer.weight)
    if on:
        want = cpu_kernels.int4_gemv(x, *gguf_int4.pack_int4_gemv(q, scales_zeros))
    else:
        want = torch._weight_int4pack_mm_for_cpu(
            x, torch._convert_weight_to_int4pack_for_cpu(q, 1), gguf_int4.GROUP_SIZE,
            scales_zeros)
    assert torch.equal(layer.quant_method.apply(layer, x), want)
    head = Layer(torch.randn(64, 96, dtype=torch.bfloat16))
    gguf_int4.attach_int8(head, head.weight)
    assert head.int8_gemv is on
    want = (cpu_kernels.int8_gemv if on else torch._weight_int8pack_mm)(
        x, head.int8_weight, head.int8_scales)
    assert torch.equal(gguf_int4.int4_logits(head, x), want)

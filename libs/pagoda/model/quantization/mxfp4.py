"""MXFP4 checkpoints (config.json `quant_method: "mxfp4"`): gpt-oss's MoE experts.

OCP microscaling FP4: each run of 32 consecutive weights along a row shares one
power-of-two scale. A checkpoint stores, per quantized tensor `W [..., rows, cols]`:

    <name>_blocks  uint8 [..., rows, cols / 32, 16]   two E2M1 codes per byte, low nibble first
    <name>_scales  uint8 [..., rows, cols / 32]       the block's exponent, biased by 127

and W[..., r, 32 g + j] = FP4[code j of block g] * 2 ** (scale[r, g] - 127), FP4 being
the 16 E2M1 values below (transformers' `integrations/mxfp4.py`, OpenAI's reference).

Pagoda dequantizes on load (`dequantize_mxfp4`): the model holds the experts in the
model dtype, so MXFP4 saves disk and download, not memory. Only the experts are
quantized in these checkpoints, and only gpt-oss reads `*_blocks`/`*_scales`: every
other architecture is refused when its first linear layer is built
(`Mxfp4Config.get_linear_method`; the gpt-oss model builds its layers outside the
quantization context).
"""

from __future__ import annotations

import torch

from pagoda.model.quantization.base import LinearMethodBase, QuantizationConfig

# E2M1 code -> value: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # weights per shared scale
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype`.

    Exact in fp32 and bf16 (an E2M1 value times a power of two) while the exponent
    stays in the dtype's range.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not match ([..., G, 16] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    codes = blocks.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [..., G, 32]: low nibble, then high, byte by byte
    exponents = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponents.unsqueeze(-1).to(dtype))
    return out.flatten(-2).to(dtype)


class Mxfp4Config(QuantizationConfig):
    """vLLM's `mxfp4`: experts dequantized by the model that reads them (gpt-oss)."""

    name = "mxfp4"

    @classmethod
    def from_config(cls, config: dict) -> Mxfp4Config:
        return cls()

    def check_architecture(self, architecture: str) -> None:
        if architecture != "GptOssForCausalLM":
            raise ValueError(f"MXFP4 (quant_method mxfp4) checkpoints are supported for gpt-oss "
                             f"(GptOssForCausalLM) only, whose MoE experts they quantize, not "
                             f"for {architecture}: use an unquantized, fp8, awq or gptq "
                             "checkpoint of it")

    def get_linear_method(self) -> LinearMethodBase:
        raise ValueError("MXFP4 (quant_method mxfp4) checkpoints are supported for gpt-oss "
                         "(GptOssForCausalLM) only, whose MoE experts they quantize; for this "
                         "architecture use an unquantized, fp8, awq or gptq checkpoint")

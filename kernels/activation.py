"""Gated activations: `[N, 2I] -> [N, I]`, `act(x[:, :I]) * x[:, I:]`.

`silu_and_mul` (SwiGLU: Llama, Qwen, Phi-3) and `gelu_tanh_and_mul` (GeGLU with
transformers' `gelu_pytorch_tanh`: Gemma). Each fuses the MLP's activation with its
gate product so the `[N, 2I]` output of the merged gate/up projection is read once.
Rounding matches HF: the activation is rounded to the activation dtype before the
multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_tensor
from pagoda.kernels._math import tanh

_BLOCK = 1024
_SILU, _GELU_TANH = 0, 1


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr,
                        BLOCK: tl.constexpr, ACTIVATION: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if ACTIVATION == 0:  # silu
        act = g / (1.0 + tl.exp(-g))
    else:  # gelu, tanh approximation: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
        act = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    out = act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, activation: int) -> torch.Tensor:
    num_rows, width = x.shape
    check_tensor("x", x, (num_rows, width), FLOAT_DTYPES)
    assert width % 2 == 0, f"x: last dim {width} is not 2 * intermediate_size"
    inter = width // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    if num_rows > 0:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        _act_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), INTER=inter, BLOCK=block, ACTIVATION=activation)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2I] -> silu(gate) * up, [N, I] (a new tensor)."""
    return _act_and_mul(x, _SILU)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2I] -> gelu_tanh(gate) * up, [N, I] (a new tensor)."""
    return _act_and_mul(x, _GELU_TANH)

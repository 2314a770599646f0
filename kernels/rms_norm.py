"""RMSNorm, optionally fused with the residual add that precedes it in a Llama block.

One program per row. Rounding matches HF's LlamaRMSNorm (and the reference): the
sum `x + residual` is rounded to the activation dtype (HF adds in that dtype), the
normalised row is rounded before the weight multiply, and the product is rounded.
With `unit_offset` it is Gemma's RMSNorm instead: the row is scaled by `1 + weight`
in fp32 and rounded once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_same_device, check_tensor, next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        out = h * rstd * (1.0 + w)
    else:
        out = (h * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [N, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [N, hidden]
    unit_offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rmsnorm(x) * weight` (`* (1 + weight)` with `unit_offset`); with `residual`:
    `r = x + residual`, returns `(rmsnorm(r) * weight, r)`. Out of place: inputs are
    never modified."""
    num_rows, hidden = x.shape
    check_tensor("x", x, (num_rows, hidden), FLOAT_DTYPES)
    check_tensor("weight", weight, (hidden,), (x.dtype,))
    check_same_device(x=x, weight=weight)
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    residual_out = out
    if residual is not None:
        check_tensor("residual", residual, (num_rows, hidden), (x.dtype,))
        check_same_device(x=x, residual=residual)
        residual_out = torch.empty_like(out)
    if num_rows > 0:
        block = next_power_of_2(hidden)
        _rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, out, residual_out, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0,
            out.stride(0), residual_out.stride(0),
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            UNIT_OFFSET=unit_offset,
            num_warps=min(16, max(1, block // 512)),
        )
    return out if residual is None else (out, residual_out)

"""Building blocks of a Llama-family decoder: linear, RMSNorm (Llama and Gemma), SwiGLU, GeGLU.

Parameters are allocated uninitialised (torch.empty) on the current default
device and dtype: weights always come from a checkpoint via `load_weights`, so
random initialisation would only cost start-up time. They never require grad.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def empty_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b), W: [out_features, in_features] as in HF checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features, dtype=dtype)
        self.bias = empty_parameter(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]; also the LM head when tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(vocab_size, hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add.

    `forward(x, residual)` returns `(norm(x + residual), x + residual)`; with
    residual=None it returns `(norm(x), x)`. Statistics are computed in fp32 and
    the result cast back before the weight multiply, as transformers does, so the
    bf16 rounding matches HF.
    """

    unit_offset = False  # True for GemmaRMSNorm, which scales by 1 + weight

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed, x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by `1 + weight` (checkpoints store the offset from 1),
    and, unlike Llama's, multiplies in fp32 before the one cast back."""

    unit_offset = True

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the fused projection: [T, 2I] -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU on the fused projection: [T, 2I] -> gelu_tanh(gate) * up, [T, I] (Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up

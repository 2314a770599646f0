"""GGUF 4-bit checkpoints run from 4-bit weights in small CPU steps.

A decode step of a few rows is bound by reading the weights: in bf16, SmolLM2-135M's
linear layers read 268 MB per step; packed to 4 bits with a bf16 scale and zero per
32 inputs they read 75 MB, and torch's `_weight_int4pack_mm_for_cpu` multiplies from
that form directly (on this 2-core Zen 5: 2.5 ms against 10 ms for the 30 layers at one
row). With more rows the bf16 product wins, so each layer keeps both forms and picks
by the step's row count: up to `MAX_INT4_ROWS` rows against `F.linear` (int4 is 14%
slower at 32 rows), up to `MAX_INT4_ROWS_PACKED` against oneDNN-prepacked bf16 weights
(`pagoda.model.cpu_packed_weights`, the default; 30 layers at 8 rows: 4.9 ms prepacked
against 8.1 ms int4, at 1 row 3.6 against 2.3 ms).

Why it is exact for Q4_1: llama.cpp's Q4_1 quantizer maps each block of 32 weights to
`d * q + m` with `m` the block's minimum and `d = (max - min) / 15`, so the block's
min and max sit on q = 0 and q = 15. Re-deriving (d, m) from the min and max of the
loaded (bf16) weights and rounding gives back every q; only d and m carry bf16's
rounding, as the bf16 weights themselves do. Q4_0 blocks (`d * (q - 8)`) need not
reach both ends of the grid, so they are re-quantized with a small extra error.

Invariants: `int4_weight` and `int4_scales_zeros` encode `W[n, k] = (q[n, k] - 8) *
scale[k // 32, n] + zero[k // 32, n]` (torch's packed form); a layer's output for a
row depends on the number of rows in the step (two kernels), so batch-invariant mode
never enables this.

The product itself (issue 28): with the C++ kernels loaded and PAGODA_CPU_GEMV on (the
default), a layer holds the same (q, scale, zero) in the layout of Pagoda's skinny GEMV
instead (`gemv_int4_weight`, `gemv_int4_scales`: kernels/cpu/csrc/gemv.h, ~2x torch's
int4 kernel at one row), and an int8 head is multiplied by its int8 GEMV; a layer holds
one form or the other, never both, chosen when it is packed.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import pagoda.envs as envs
from pagoda.kernels import cpu as cpu_kernels
from pagoda.model.quantization.base import LinearMethodBase, UnquantizedLinearMethod

logger = logging.getLogger(__name__)
GROUP_SIZE = 32
# Steps of at most this many rows use the 4-bit product: measured crossovers, ~20 rows
# against F.linear's bf16 product and ~4 against the prepacked one.
MAX_INT4_ROWS = 16
MAX_INT4_ROWS_PACKED = 4
# GGUF tensor types whose blocks are 32 weights of 4 bits with a scale (and min).
GGUF_4BIT_TYPES = ("Q4_0", "Q4_1")


def available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu")


def gguf_4bit_parts(path: str) -> tuple[bool, str | None]:
    """(every layer matrix is 4-bit, the output head's packed form: "int4" for a 4-bit
    head, "int8" for a Q8_0 one, None otherwise) for a GGUF file. A tied head is the
    token embedding; SmolLM2's Q4_1 file keeps it in Q8_0: 4 bits would round it, so it
    gets per-row int8 (its rounding is of the order of Q8_0's own, a step of at most
    the row's largest block scale)."""
    from pagoda.model.gguf_loader import gguf_metadata  # lazy: the gguf package, GGUF only

    layers, head = set(), set()
    for tensor in gguf_metadata(path).tensors:
        if len(tensor.shape) != 2:
            continue
        kind = tensor.tensor_type.name
        if tensor.name.startswith("blk."):
            layers.add(kind)
        elif tensor.name.startswith(("output.", "token_embd.")):
            head.add(kind)
    four_bit = set(GGUF_4BIT_TYPES)
    head_form = "int4" if head and head <= four_bit else "int8" if head == {"Q8_0"} else None
    return bool(layers) and layers <= four_bit, head_form


def resolve_gguf_int4(asked: bool | None, gguf_path: str | None, device: str, dtype,
                      batch_invariant: bool, enable_lora: bool) -> bool:
    """Whether the engine runs small steps from the 4-bit weights: on where it applies
    (`asked` None), off when `asked` is False; `asked` True where it cannot apply is a
    ValueError naming why. `gguf_path`: the model's GGUF file, None for any other model."""
    if asked is False:
        return False
    why = None
    if gguf_path is None or not gguf_4bit_parts(gguf_path)[0]:
        why = "the model is not a GGUF file whose layers are Q4_0 or Q4_1"
    elif device != "cpu" or dtype != torch.bfloat16:
        why = "it runs on the CPU in bfloat16 only"
    elif batch_invariant:
        why = "--batch-invariant needs one kernel whatever the step's size"
    elif enable_lora:
        why = "not with --enable-lora"
    elif not available():
        why = "this torch has no _weight_int4pack_mm_for_cpu"
    if why is not None and asked:
        raise ValueError(f"--gguf-int4: {why}")
    return why is None


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int32 [N, K] of 0..15, scales_and_zeros bf16 [K/32, N, 2])
    with min/max per group of 32 inputs (see the module docstring)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((groups - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15)
    zero = lo + 8 * scale
    scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
    return q.reshape(n, k).to(torch.int32), scales_zeros.to(torch.bfloat16)


class SmallBatchInt4Method(LinearMethodBase):
    """Wraps a layer's unquantized method: steps of at most `max_rows` rows multiply
    from the packed 4-bit copy, larger ones from the bf16 weight."""

    def __init__(self, base: LinearMethodBase, max_rows: int = MAX_INT4_ROWS) -> None:
        self.base = base
        self.max_rows = max_rows

    def create_weights(self, layer, input_size, output_size, full_input_size, params_dtype):
        self.base.create_weights(layer, input_size, output_size, full_input_size, params_dtype)

    def apply(self, layer, x, bias=None):
        rows = x.numel() // x.shape[-1]
        if rows > self.max_rows or x.dtype != torch.bfloat16:
            return self.base.apply(layer, x, bias)
        # The kernel reads its input as a dense [rows, K] matrix: a strided view (a
        # slice of a fused projection's output) would be read wrongly. The buffers are
        # read from `_buffers` directly: nn.Module's attribute fallback costs about a
        # microsecond a lookup, and this runs 120 times a token at one row.
        buffers = layer._buffers
        packed = buffers.get("gemv_int4_weight")
        if packed is not None:
            out = cpu_kernels.int4_gemv(x.reshape(rows, x.shape[-1]), packed,
                                        buffers["gemv_int4_scales"])
        else:
            out = torch._weight_int4pack_mm_for_cpu(
                x.reshape(rows, x.shape[-1]).contiguous(), buffers["int4_weight"], GROUP_SIZE,
                buffers["int4_scales_zeros"])
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias


def packable(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and k % GROUP_SIZE == 0 and n % 16 == 0)


def gemv_enabled() -> bool:
    """Whether layers packed now get the skinny GEMV's layout (see the module doc)."""
    return bool(envs.get("PAGODA_CPU_GEMV")) and cpu_kernels.available()


def pack_int4_gemv(q: torch.Tensor, scales_zeros: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] of 0..15, scales_zeros bf16 [K/32, N, 2]) -> gemv.h's layout: packed
    uint8 [N/16, K/32, 256] (per 16-row tile and group, chunk c's byte 2i + j holds
    row i's q at k = 4c + j low and 4c + 2 + j high) and scales bf16 [N/16, K/32, 2, 16]
    (16 scales, then 16 zeros)."""
    n, k = q.shape
    tiles, groups = n // 16, k // GROUP_SIZE
    # [tile, row, group, chunk, half, j] with k = 32 group + 4 chunk + 2 half + j
    v = q.to(torch.uint8).view(tiles, 16, groups, 8, 2, 2).permute(0, 2, 3, 1, 4, 5)
    packed = (v[..., 0, :] | (v[..., 1, :] << 4)).contiguous().view(tiles, groups, 256)
    scales = scales_zeros.view(groups, tiles, 16, 2).permute(1, 0, 3, 2).contiguous()
    return packed, scales


def attach_int4(layer: nn.Module, weight: torch.Tensor) -> None:
    q, scales_zeros = quantize_groups(weight)
    if gemv_enabled():
        packed, scales = pack_int4_gemv(q, scales_zeros)
        layer.register_buffer("gemv_int4_weight", packed, persistent=False)
        layer.register_buffer("gemv_int4_scales", scales, persistent=False)
        return
    layer.register_buffer("int4_weight", torch._convert_weight_to_int4pack_for_cpu(q, 1),
                          persistent=False)
    layer.register_buffer("int4_scales_zeros", scales_zeros, persistent=False)


def attach_int8(layer: nn.Module, weight: torch.Tensor) -> None:
    """Per-row symmetric int8 (torch's `_weight_int8pack_mm` form)."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
    q = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    layer.register_buffer("int8_weight", q, persistent=False)
    layer.register_buffer("int8_scales", scales.to(torch.bfloat16), persistent=False)
    # The same buffers feed either kernel; which one is chosen here, once.
    layer.int8_gemv = gemv_enabled() and weight.shape[1] % 16 == 0


def pack_small_batch_int4(model: nn.Module, head_form: str | None,
                          max_rows: int = MAX_INT4_ROWS) -> int:
    """Give every unquantized bf16 CPU linear layer of `model` its packed copy and
    switch it to `SmallBatchInt4Method` (4-bit for steps of at most `max_rows` rows);
    with a `head_form`, the LM head (or the tied embedding it reads) gets a packed copy
    too ("int4" or per-row "int8"), read by its `compute_logits` through `int4_logits`.
    Runs before `prepack_cpu_weights.pack_linear_weights`: it reads the plain weights.
    Returns the number of layers packed."""
    packed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if type(method) is UnquantizedLinearMethod and packable(module.weight):
            attach_int4(module, module.weight)
            # Not set_quant_method: that makes new (empty) weights; these stay.
            module.quant_method = SmallBatchInt4Method(method, max_rows)
            packed += 1
    head = logits_head(model)
    if head_form and head is not None and packable(head.weight):
        if head_form == "int4":
            attach_int4(head, head.weight)
        else:
            attach_int8(head, head.weight)
        head.int4_max_rows = max_rows
        packed += 1
    logger.info("GGUF 4-bit weights: %d linear layers multiply from packed int4 in steps "
                "of at most %d rows", packed, max_rows)
    return packed


def logits_head(model: nn.Module) -> nn.Module | None:
    """The module whose `compute_logits` makes the logits: `lm_head`, or the tied
    embedding (`model.embed_tokens`) when there is none."""
    head = getattr(model, "lm_head", None)
    if head is None:
        head = getattr(getattr(model, "model", None), "embed_tokens", None)
    return head if hasattr(head, "compute_logits") else None


def int4_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """The LM head's product from its packed copy (int4 or int8), when it has one and
    the step is small; None otherwise (the caller multiplies by the bf16 weight)."""
    if hidden.shape[0] > getattr(head, "int4_max_rows", MAX_INT4_ROWS) \
            or hidden.dtype != torch.bfloat16:
        return None
    packed = getattr(head, "gemv_int4_weight", None)
    if packed is not None:
        return cpu_kernels.int4_gemv(hidden, packed, head.gemv_int4_scales)
    if getattr(head, "int4_weight", None) is not None:
        return torch._weight_int4pack_mm_for_cpu(hidden.contiguous(), head.int4_weight,
                                                 GROUP_SIZE, head.int4_scales_zeros)
    if getattr(head, "int8_weight", None) is not None:
        if getattr(head, "int8_gemv", False):
            return cpu_kernels.int8_gemv(hidden, head.int8_weight, head.int8_scales)
        return torch._weight_int8pack_mm(hidden.contiguous(), head.int8_weight, head.int8_scales)
    return None

"""bf16 linear layers on the CPU multiply from weights prepacked for oneDNN.

`F.linear` on a bf16 CPU tensor goes through oneDNN with the weight in its plain
[out, in] layout, and oneDNN lays it out again for its kernel on every call. For a
small model that is most of a call's time: on this 2-core Zen 5 SmolLM2-135M's 120
layer products at 32 rows take 10.8 ms from prepacked weights against ~18 ms through
`F.linear`, and the 49,152-row LM head 3.3 ms against 6.2 ms. The product itself is
the same oneDNN kernel, so results are bit-equal to `F.linear`'s at every row count;
`tests/model/test_cpu_packed_weights.py` checks that with `torch.equal`. Neither is
batch invariant at SmolLM2's widths (a row's bits depend on the row count):
batch-invariant mode calls them on fixed-size blocks (`batch_invariant_linear`).

Invariants, once `prepack_cpu_weights.pack_linear_weights(model)` has run:
- A packed layer's `weight` is the packed tensor (`weight.is_mkldnn`), the same shape
  and dtype as before; the plain copy is freed, so packing costs no memory. Only
  `linear()` (which `UnquantizedLinearMethod.apply` and the LM head call) can multiply
  by it; nothing else reads a packed layer's weight after loading.
- The tied LM head (the token embedding, whose plain table the embedding lookup
  reads) gets a packed copy in its `packed_weight` buffer instead: vocab x hidden
  bf16 more memory.
- GGUF 4-bit packing (`gguf_int4`), which reads the plain weights, runs first.

`PAGODA_CPU_PACKED_WEIGHTS=0` keeps the plain weights (and `F.linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pagoda.envs as envs
from pagoda.model.cpu_features import cpu_has_fast_bf16


def available() -> bool:
    """torch has oneDNN, and this CPU multiplies bf16 natively (AVX512-BF16 or AMX).

    Where bf16 is only emulated (AVX-512 without BF16, e.g. Ice Lake) oneDNN still
    accepts packed bf16 weights, but `F.linear` there takes another kernel: a packed
    model's logits differed from the plain model's in the last bits, breaking the
    bit-equality this module promises, and the speed-up was measured on native bf16
    only. Such CPUs keep `F.linear` (and `--dtype auto` picks float32 on them anyway).
    """
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and cpu_has_fast_bf16())


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16
            and envs.get("PAGODA_CPU_PACKED_WEIGHTS") and available())


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias), `weight` plain or packed by `pack`."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A plain bf16 [out, in] weight in oneDNN's layout (the row-count hint only picks
    among equivalent layouts; products are the same at any row count)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)

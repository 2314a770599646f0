"""The Triton batched-LoRA kernel (bgmv shrink + expand) against the torch path of
`pagoda.lora.ops` (rows grouped by adapter) and a per-row reference."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.lora import add_lora as triton_add_lora
from pagoda.lora.ops import LoRABatch, add_lora


def reference(out, x, a, b, slots):
    expected = out.clone().float()
    for t, s in enumerate(slots):
        if s >= 0:
            expected[t] += (x[t].float() @ a[s].float().t()) @ b[s].float().t()
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_adapters_and_base_rows(device, dtype):
    torch.manual_seed(0)
    num_slots, rank, k, n = 3, 12, 40, 72  # not powers of two: masked tails
    slots = [2, -1, 0, 0, 1, -1, 2]
    x = torch.randn(len(slots), k, dtype=dtype, device=device)
    a = torch.randn(num_slots, rank, k, dtype=dtype, device=device) * 0.2
    b = torch.randn(num_slots, n, rank, dtype=dtype, device=device) * 0.2
    out = torch.randn(len(slots), n, dtype=dtype, device=device)
    expected = reference(out, x, a, b, slots)
    got = triton_add_lora(out.clone(), x, a, b, torch.tensor(slots, device=device))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), expected, **tol)
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base_rows], out[base_rows])  # untouched, bit for bit


def test_torch_path_groups_rows_by_adapter():
    torch.manual_seed(1)
    slots = [1, -1, 0, 1]
    x, a, b = torch.randn(4, 8), torch.randn(2, 4, 8), torch.randn(2, 6, 4)
    out = torch.randn(4, 6)
    expected = reference(out, x, a, b, slots)
    got = add_lora(out.clone(), x, a, b, LoRABatch.from_slots(slots, "cpu"))
    torch.testing.assert_close(got, expected)

"""Batch-invariant mode's linear products: a row's output does not depend on how many
rows the step has, where the row sits in it, or what the other rows hold.

SmolLM2-135M's down projection (K = 1,536) and a head over its hidden size: without
fixed-size calls oneDNN's bf16 GEMM gives rows of a 33-row or larger step other bits
than the same rows alone (a tiny model's K is too small to show it).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.model import cpu_packed_weights, prepack_cpu_weights
from pagoda.model.batch_invariant_linear import (FIXED_ROWS, FixedRowsLinearMethod,
                                                 fix_linear_rows, in_fixed_rows)
from pagoda.model.parallel_layers import ParallelLMHead, RowParallelLinear

ROW_COUNTS = [1, 2, 3, 5, 9, 17, 31, 32, 33, 63, 65]


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.down_proj = RowParallelLinear(1536, 576, bias=False, dtype=torch.bfloat16)
        self.lm_head = ParallelLMHead(8192, 576, dtype=torch.bfloat16)
        with torch.no_grad():
            self.down_proj.weight.normal_(0, 0.05)
            self.lm_head.weight.normal_(0, 0.05)


@pytest.fixture(scope="module", params=["plain", "prepacked"])
def model(request) -> _Model:
    model = _Model()
    if request.param == "prepacked":
        if not cpu_packed_weights.available():
            pytest.skip("torch without oneDNN bf16 on this CPU")
        prepack_cpu_weights.pack_linear_weights(model)
    assert fix_linear_rows(model, model.lm_head) == 1
    assert isinstance(model.down_proj.quant_method, FixedRowsLinearMethod)
    return model


def test_each_row_equals_its_solo_product_at_every_row_count(model):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(max(ROW_COUNTS), 1536, generator=g).to(torch.bfloat16)
    hidden = torch.randn(max(ROW_COUNTS), 576, generator=g).to(torch.bfloat16)
    solo = torch.cat([model.down_proj(x[i:i + 1]) for i in range(len(x))])
    solo_logits = torch.cat([model.lm_head.compute_logits(hidden[i:i + 1])
                             for i in range(len(hidden))])
    for rows in ROW_COUNTS:
        assert torch.equal(model.down_proj(x[:rows]), solo[:rows]), rows
        assert torch.equal(model.lm_head.compute_logits(hidden[:rows]), solo_logits[:rows]), rows
    # Shuffled, with other companions: a row's place in the step does not matter either.
    perm = torch.randperm(len(x), generator=g)
    assert torch.equal(model.down_proj(x[perm]), solo[perm])
    assert torch.equal(model.lm_head.compute_logits(hidden[perm]), solo_logits[perm])


def test_in_fixed_rows_calls_the_product_on_fixed_size_blocks_only():
    seen = []

    def product(rows: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(rows.shape))
        assert rows.is_contiguous()
        return rows * 2

    x = torch.arange(2 * 35 * 3, dtype=torch.float32).reshape(2, 35, 3)[:, :, :2]  # strided
    assert torch.equal(in_fixed_rows(product, x, rows=32), x * 2)
    assert seen == [(32, 2)] * 3  # 70 rows: two full blocks and one padded
    seen.clear()
    assert in_fixed_rows(product, x[:0].reshape(0, 2)).shape == (0, 2)
    assert seen == [(FIXED_ROWS, 2)]

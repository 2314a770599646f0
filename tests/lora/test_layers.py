"""LoRA stacks of one layer: fused parts and tensor-parallel slices add up to the
unsharded PEFT product (no process group needed: each rank's share is computed alone)."""

from __future__ import annotations

import torch

from pagoda.distributed.parallel_state import ParallelContext
from pagoda.lora.layers import LoRAContext, LoRALinear
from pagoda.lora.ops import LoRABatch
from pagoda.model.parallel_layers import QKVParallelLinear, RowParallelLinear

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, RANK = 16, 4, 4, 2, 3


def lora_delta(layer, weights, x: torch.Tensor) -> torch.Tensor:
    """This rank's LoRA output for x with the adapter in slot 1 (slot 0 left empty)."""
    context = LoRAContext()
    lora = LoRALinear(layer, context, max_loras=2, max_rank=8, device=torch.device("cpu"),
                      dtype=torch.float32)
    lora.set_slot(1, weights)
    context.batch = LoRABatch.from_slots([1] * x.shape[0], "cpu")
    return lora.add_to(x, torch.zeros(x.shape[0], layer.output_size))


def test_qkv_parts_and_column_parallel_slices():
    torch.manual_seed(0)
    rows = {"q_proj": HEADS * HEAD_DIM, "k_proj": KV_HEADS * HEAD_DIM, "v_proj": KV_HEADS * HEAD_DIM}
    weights = {name: (torch.randn(RANK, HIDDEN), torch.randn(n, RANK)) for name, n in rows.items()}
    del weights["k_proj"]  # an adapter may skip a part: its rows stay the base layer's
    x = torch.randn(5, HIDDEN)
    full = {name: x @ a.t() @ b.t() for name, (a, b) in weights.items()}
    full["k_proj"] = torch.zeros(5, rows["k_proj"])
    for tp in (1, 2):
        for rank in range(tp):
            layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, False, torch.float32,
                                      ParallelContext(tp_size=tp, tp_rank=rank))
            got = lora_delta(layer, weights, x)
            expected = torch.cat([full[name].narrow(1, start, n)
                                  for name, (_, start, n) in layer.parts.items()], dim=1)
            torch.testing.assert_close(got, expected)


def test_row_parallel_partial_deltas_sum_to_the_full_delta():
    torch.manual_seed(1)
    in_features, out_features = 12, 10
    a, b = torch.randn(RANK, in_features), torch.randn(out_features, RANK)
    x = torch.randn(4, in_features)
    expected = x @ a.t() @ b.t()
    total = torch.zeros(4, out_features)
    for rank in range(2):
        layer = RowParallelLinear(in_features, out_features, False, torch.float32,
                                  ParallelContext(tp_size=2, tp_rank=rank))
        cols = in_features // 2
        total += lora_delta(layer, {None: (a, b)}, x[:, rank * cols:(rank + 1) * cols])
    torch.testing.assert_close(total, expected)

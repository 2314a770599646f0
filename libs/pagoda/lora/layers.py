"""Per-layer LoRA state: device stacks of every resident adapter's A and B for one base
linear layer, sliced the way the base layer is sliced under tensor parallelism.

A fused layer (qkv_proj: q, k, v; gate_up_proj: gate, up) is one LoRA of rank P * R for
its P parts: part j's A fills rows [jR, jR + r) of the A stack and its B the block
(part j's local output rows) x [jR, jR + r) of the B stack, zeros elsewhere, so one
shrink and one expand give every part its own product:

    A stack [S, P*R, K]        B stack [S, N_local, P*R]
    +--------+                 +-----+-----+-----+
    | A_q    |  rows 0..R      | B_q |  0  |  0  |  q rows
    | A_k    |  rows R..2R     |  0  | B_k |  0  |  k rows
    | A_v    |  rows 2R..3R    |  0  |  0  | B_v |  v rows
    +--------+                 +-----+-----+-----+

Tensor parallelism, as the base weights: column-parallel (qkv, gate_up) shards B on its
output rows (each part's rank slice, `ColumnParallelLinear.parts`), A whole; row-parallel
(o_proj, down_proj) shards A on its input columns, B whole, and the delta is added to the
partial product before the all-reduce, which sums sum_r (x_r A_r^T) B^T = (x A^T) B^T.
"""

from __future__ import annotations

import torch

from pagoda.lora.ops import LoRABatch, add_lora
from pagoda.model.parallel_layers import ColumnParallelLinear


class LoRAContext:
    """The step's `LoRABatch`, shared by every adapted layer of one model (set by the
    `LoRAModelManager` before each forward; None: no row has an adapter)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear:
    """LoRA stacks for one base layer; `add_to(x, out)` is the layer's hook.

    Deliberately not an nn.Module: the stacks are not checkpoint parameters, so weight
    loading and `named_parameters` never see them. Invariant: slot s holds exactly the
    adapter the manager assigned it (zeros for an empty slot or a module it skips).
    """

    def __init__(self, layer, context: LoRAContext, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.context = context
        self.max_rank = max_rank
        if isinstance(layer, ColumnParallelLinear):
            # part -> (full rows, first local row, local rows, local offset)
            self.parts = {name: (*spec, layer.offsets[name]) for name, spec in layer.parts.items()}
            self.input_slice = None
            in_features, out_features = layer.in_features, layer.output_size
        else:
            self.parts = {None: (layer.output_size, 0, layer.output_size, 0)}
            cols = layer.input_size
            self.input_slice = (layer.parallel.tp_rank * cols, cols)
            in_features, out_features = cols, layer.output_size
        rank = max_rank * len(self.parts)
        self.a_stack = torch.zeros(max_loras, rank, in_features, dtype=dtype, device=device)
        self.b_stack = torch.zeros(max_loras, out_features, rank, dtype=dtype, device=device)

    def set_slot(self, slot: int,
                 weights: dict[str | None, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Write one adapter's full-size (A, B) pairs for this layer into `slot`
        (None or a missing part: zeros, i.e. the base layer)."""
        self.a_stack[slot].zero_()
        self.b_stack[slot].zero_()
        for j, (name, (full_rows, start, rows, offset)) in enumerate(self.parts.items()):
            if not weights or name not in weights:
                continue
            a, b = weights[name]
            r = a.shape[0]
            if b.shape[0] != full_rows:
                raise ValueError(f"LoRA B of {name or 'layer'} has {b.shape[0]} rows, the "
                                 f"layer {full_rows}")
            if self.input_slice is not None:
                a = a.narrow(1, *self.input_slice)
            col = j * self.max_rank
            self.a_stack[slot, col:col + r].copy_(a)
            self.b_stack[slot, offset:offset + rows, col:col + r].copy_(b.narrow(0, start, rows))

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        batch = self.context.batch
        if batch is None or batch.is_empty:
            return out
        return add_lora(out, x.reshape(-1, x.shape[-1]), self.a_stack, self.b_stack, batch)

"""The batched LoRA product, one call per adapted layer per step.

`add_lora(out, x, a_stack, b_stack, batch)` adds `(x[t] A_s^T) B_s^T` to each row t whose
adapter sits in slot s (`LoRABatch`), and leaves rows without one untouched. On CUDA it
is the Triton bgmv kernel (`pagoda.kernels.lora`); on CPU, torch groups the rows by slot
(one shrink and one expand matmul per adapter in the step), which is exact per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.model.ops import use_triton


@dataclass
class LoRABatch:
    """This step's row -> slot map. Invariant: `groups` lists every slot used in
    `token_slots` with exactly the rows that use it (built once per step, read by
    every layer)."""

    token_slots: torch.Tensor  # [T] int64, -1 for rows without an adapter
    groups: list[tuple[int, torch.Tensor]]  # (slot, row indices)

    @classmethod
    def from_slots(cls, slots: list[int], device: torch.device | str) -> "LoRABatch":
        token_slots = torch.tensor(slots, dtype=torch.int64)
        groups = [(s, (token_slots == s).nonzero().flatten().to(device))
                  for s in sorted(set(slots)) if s >= 0]
        return cls(token_slots.to(device), groups)

    @property
    def is_empty(self) -> bool:
        return not self.groups


def add_lora(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             batch: LoRABatch) -> torch.Tensor:
    """out [T, N] += per-row LoRA of x [T, K]; a_stack [S, R, K], b_stack [S, N, R]."""
    if batch.is_empty:
        return out
    if use_triton(x):
        from pagoda.kernels.lora import add_lora as kernel  # lazy: Triton, only on CUDA

        return kernel(out, x, a_stack, b_stack, batch.token_slots)
    for slot, rows in batch.groups:
        delta = (x.index_select(0, rows) @ a_stack[slot].t()) @ b_stack[slot].t()
        out.index_add_(0, rows, delta.to(out.dtype))
    return out

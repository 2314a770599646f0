"""A sparse MoE block with a shared expert that every token runs (Qwen2-MoE's layout).

    x ──┬── router ── routed experts (`moe.FusedMoE`) ───────────────────(+)── out
        ├── shared_expert: GatedMLP(x)  × sigmoid(shared_expert_gate(x)) ─┘
        └── (no gate: the shared expert's output is added as is)

The shared expert is a dense `GatedMLP`, split over the tensor-parallel ranks like any
dense MLP (also under `--enable-expert-parallel`, which only places the routed
experts); its gate, a [1, H] projection, is replicated and never quantized, as is the
router. Invariant: every TP rank returns the full output (each branch reduces its own
partial sum, so the gate scales a complete output).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.distributed.parallel_state import SINGLE, ParallelContext
from pagoda.model.decoder_layer import GatedMLP
from pagoda.model.moe import Router, SparseMoeBlock


class SharedExpertMoeBlock(nn.Module):
    """`gate` (router), `experts`, `shared_expert` and, with `gated`, `shared_expert_gate`
    (HF's names). `SparseMoeBlock`'s arguments plus the shared expert's width."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 shared_intermediate_size: int, renormalize: bool, dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE, gated: bool = True,
                 hidden_act: str = "silu", **experts_options) -> None:
        super().__init__()
        if shared_intermediate_size % parallel.tp_size:
            raise ValueError(f"Shared expert intermediate size ({shared_intermediate_size}) "
                             "must be divisible by tensor parallel size "
                             f"({parallel.tp_size})")
        routed = SparseMoeBlock(num_experts, top_k, hidden_size, intermediate_size,
                                renormalize, dtype, parallel, **experts_options)
        self.gate, self.experts = routed.gate, routed.experts
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, dtype, parallel,
                                      hidden_act)
        self.shared_expert_gate = Router(1, hidden_size, dtype) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.experts(x, self.gate(x)) + shared

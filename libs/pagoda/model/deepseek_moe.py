"""DeepSeek's mixture-of-experts MLP: group-limited routing and ungated shared experts.

    x ── router (fp32) ── top-k ids, weights ── routed experts (`moe.FusedMoE`) ──(+)── out
    └──────────────────── shared experts (a plain `GatedMLP`, no gate) ─────────────┘

Routing (transformers' DeepseekV2/V3 TopkRouter, vLLM's `grouped_topk`), on logits
x W^T computed in fp32 from an fp32 router weight:

- `softmax` scoring (V2): `greedy` takes the top k of all experts;
  `group_limited_greedy` ranks the `n_group` groups by their best expert, keeps the
  best `topk_group` groups and takes the top k among their experts.
- `sigmoid` scoring (V3, `noaux_tc`): experts are chosen on sigmoid scores plus the
  checkpoint's `e_score_correction_bias`; a group's rank is the sum of its two best
  biased scores. The weights are the unbiased sigmoid scores of the chosen experts,
  renormalised with `norm_topk_prob` (sum + 1e-20, as transformers does).

Both multiply the weights by `routed_scaling_factor`. Checkpoint names: `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias` (V3), `mlp.experts.<e>.{gate,up,down}_proj`,
`mlp.shared_experts.{gate,up,down}_proj`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.parallel_state import SINGLE, ParallelContext
from pagoda.model.decoder_layer import GatedMLP
from pagoda.model.layers import empty_parameter
from pagoda.model.moe import FusedMoE

SCORING_FUNCTIONS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class DeepseekRouting:
    """How a DeepSeek router picks `top_k` of `num_experts` experts (module doc)."""

    num_experts: int
    top_k: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCTIONS:
            raise ValueError(f"Unsupported DeepSeek scoring_func {self.scoring_func!r}; "
                             f"supported: {', '.join(SCORING_FUNCTIONS)}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"Unsupported DeepSeek topk_method {self.topk_method!r}; "
                             f"supported: {', '.join(TOPK_METHODS)}")
        if self.grouped and (self.num_experts % self.n_group
                             or not 0 < self.topk_group <= self.n_group):
            raise ValueError(f"n_group={self.n_group}, topk_group={self.topk_group} do not "
                             f"fit {self.num_experts} routed experts")

    @property
    def grouped(self) -> bool:
        return self.topk_method != "greedy"


def grouped_topk(logits: torch.Tensor, routing: DeepseekRouting,
                 correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (fp32) -> (weights [T, k] fp32, expert ids [T, k])."""
    r = routing
    if r.scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if r.grouped:
        grouped = choice.view(-1, r.n_group, r.num_experts // r.n_group)
        if correction_bias is None:  # V2: a group ranks by its best expert
            group_scores = grouped.max(dim=-1).values
        else:  # V3: by the sum of its two best (biased) scores
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=r.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.bool()[:, :, None].expand_as(grouped).reshape(-1, r.num_experts)
        # V2 zeroes the other groups' scores, V3 drops them with -inf (transformers).
        choice = choice.masked_fill(~keep, 0.0 if correction_bias is None else float("-inf"))
    ids = torch.topk(choice, k=r.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if r.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * r.routed_scaling_factor, ids


class DeepseekRouter(nn.Module):
    """`mlp.gate`: weight [E, H] (kept fp32, as transformers keeps it) and, with sigmoid
    scoring, `e_score_correction_bias` [E] from the checkpoint. Replicated on every rank."""

    def __init__(self, routing: DeepseekRouting, hidden_size: int) -> None:
        super().__init__()
        self.routing = routing
        self.weight = empty_parameter(routing.num_experts, hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = (
            empty_parameter(routing.num_experts, dtype=torch.float32)
            if routing.scoring_func == "sigmoid" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        return grouped_topk(logits, self.routing, self.e_score_correction_bias)


class DeepseekMoE(nn.Module):
    """Routed experts plus `n_shared_experts` shared ones (one GatedMLP of
    n_shared_experts * moe_intermediate_size, added for every token, ungated).
    Each part's output is already reduced over the TP group."""

    def __init__(self, routing: DeepseekRouting, hidden_size: int, intermediate_size: int,
                 n_shared_experts: int, dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE, hidden_act: str = "silu") -> None:
        super().__init__()
        self.gate = DeepseekRouter(routing, hidden_size)
        self.experts = FusedMoE(routing.num_experts, routing.top_k, hidden_size,
                                intermediate_size, routing.norm_topk_prob, dtype, parallel)
        self.shared_experts = (
            GatedMLP(hidden_size, intermediate_size * n_shared_experts, dtype, parallel,
                     hidden_act) if n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts.forward_routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

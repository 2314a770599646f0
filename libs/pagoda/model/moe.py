"""Mixture-of-experts feed-forward: a router picks k experts per token, the experts run
batched per step (vLLM's `FusedMoE`, its names).

    x [T, H] ── router logits [T, E] ── softmax (fp32) ── top-k ids, weights [T, k]
                                                          (renormalised: norm_topk_prob)
    (token, slot) pairs sorted by expert ── each expert this rank holds runs one
    SwiGLU on its group of tokens ── weighted sum over the k slots ── all-reduce ── [T, H]

Sharding over the T tensor-parallel ranks of a stage:

    default (TP)   every expert, I/T of its intermediate rows, split like `GatedMLP`:
                   gate/up by output rows, down by input columns
    --enable-expert-parallel (EP)
                   experts [e0, e1) whole (`expert_range`); a token's other experts
                   contribute nothing on this rank

Either way each rank's output is a partial sum, completed by one all-reduce: the cost
of a dense MLP. Loops run over experts, never over tokens: on the CPU one matmul pair
per expert that has tokens this step; on CUDA a grouped GEMM over the sorted pairs
(`pagoda.kernels.fused_moe`), which needs no host sync and so runs inside CUDA graphs.

Checkpoints store one tensor per expert and projection (HF's layout on disk):
`<prefix>.<e>.<gate|up|down>.weight`; the module reads them itself
(`checkpoint_tensors`, `load_checkpoint_tensor`, used by `weight_names`). In a
quantized checkpoint (FP8, compressed-tensors FP8, AWQ, GPTQ) each projection is that
method's tensors instead, dequantized on load (`moe_quantized`): the experts always
run in the model dtype.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.communication import all_reduce
from pagoda.distributed.parallel_state import SINGLE, ParallelContext, expert_range
from pagoda.model import ops
from pagoda.model.layers import empty_parameter
from pagoda.model.moe_quantized import ExpertDequantizer
from pagoda.model.quantization import current_quant_config


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]).

    Softmax over all experts in fp32, then the k largest (HF's order: descending);
    `renormalize` rescales the k weights to sum to 1 (Mixtral, Qwen's norm_topk_prob).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """This rank's share of one layer's experts and their batched forward.

    Parameters: `w13_weight [E_local, 2 I_local, H]` (each expert's gate rows, then
    its up rows) and `w2_weight [E_local, H, I_local]`; `E_local = e1 - e0` experts
    starting at global id `e0`. Invariant: `forward` returns the full, reduced output on
    every TP rank; with T = 1 no collective is issued. `round_weights`: the routing
    weights are rounded to the model dtype before weighing (Qwen-MoE's HF code does,
    Mixtral's keeps them fp32).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, parallel: ParallelContext = SINGLE,
                 checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 round_weights: bool = False) -> None:
        super().__init__()
        quant = current_quant_config()
        # A quantized checkpoint's experts are read in its form and dequantized on load
        # (None: plain weights, also for experts the checkpoint leaves unquantized).
        self.dequantizer = ExpertDequantizer(quant, dtype) if quant is not None else None
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.round_weights = round_weights
        self.parallel = parallel
        self.expert_start, self.expert_end = expert_range(num_experts, parallel)
        split = 1 if parallel.enable_expert_parallel else parallel.tp_size
        if intermediate_size % split:
            raise ValueError(f"MoE intermediate size ({intermediate_size}) must be divisible "
                             f"by tensor parallel size ({split}) without expert parallelism")
        self.intermediate_size = intermediate_size
        self.local_intermediate = intermediate_size // split
        self.intermediate_start = (0 if parallel.enable_expert_parallel
                                   else parallel.tp_rank * self.local_intermediate)
        local = self.expert_end - self.expert_start
        self.hidden_size = hidden_size
        self.w13_weight = empty_parameter(local, 2 * self.local_intermediate, hidden_size,
                                          dtype=dtype)
        self.w2_weight = empty_parameter(local, hidden_size, self.local_intermediate, dtype=dtype)
        self.gate_name, self.up_name, self.down_name = checkpoint_names

    # ------------------------------------------------------------------ weights
    def holds_expert(self, expert_id: int) -> bool:
        return self.expert_start <= expert_id < self.expert_end

    def checkpoint_tensors(self) -> dict[str, tuple[int, ...] | None]:
        """Checkpoint names under this module's prefix -> full shape; None for an expert
        another rank holds (expert parallelism): the loader skips those."""
        names: dict[str, tuple[int, ...] | None] = {}
        for e in range(self.num_experts):
            held = self.holds_expert(e)
            for proj in (self.gate_name, self.up_name, self.down_name):
                for attr, shape in self._tensor_shapes(proj).items():
                    names[f"{e}.{proj}.{attr}"] = shape if held else None
        return names

    def _full_shape(self, proj: str) -> tuple[int, int]:
        inter, hidden = self.intermediate_size, self.hidden_size
        return (hidden, inter) if proj == self.down_name else (inter, hidden)

    def _tensor_shapes(self, proj: str) -> dict[str, tuple[int, ...]]:
        """One projection's checkpoint tensors (attribute -> shape)."""
        if self.dequantizer is None:
            return {"weight": self._full_shape(proj)}
        return self.dequantizer.tensor_shapes(*self._full_shape(proj))

    @torch.no_grad()
    def load_checkpoint_tensor(self, suffix: str, full: torch.Tensor) -> None:
        """Copy this rank's slice of one expert's full projection (`checkpoint_tensors`);
        quantized, once the projection's last tensor is in."""
        expert, proj, attr = suffix.split(".")
        if self.dequantizer is not None:
            full = self.dequantizer.add((expert, proj), attr, full, *self._full_shape(proj))
            if full is None:
                return
        local = int(expert) - self.expert_start
        rows, start = self.local_intermediate, self.intermediate_start
        if proj == self.down_name:
            self.w2_weight[local].copy_(full.narrow(1, start, rows))
            return
        offset = 0 if proj == self.gate_name else rows
        self.w13_weight[local].narrow(0, offset, rows).copy_(full.narrow(0, start, rows))

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H], reduced over the TP group."""
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.forward_routed(x, weights, ids)

    def forward_routed(self, x: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
        """`forward` with the routing already chosen: weights [T, k] fp32, expert ids
        [T, k] (a family's own router: DeepSeek's group-limited top-k)."""
        if self.round_weights:
            weights = weights.to(x.dtype)
        if ops.use_triton(x):
            from pagoda.kernels.fused_moe import fused_experts  # lazy: triton, CUDA only
        else:
            fused_experts = experts_by_group
        pair_out = fused_experts(x, ids, self.w13_weight, self.w2_weight, self.expert_start)
        num_tokens = x.shape[0]
        # Weighted sum over the k slots in fp32 (HF weighs in fp32 too), then the model dtype.
        out = (pair_out.float() * weights.reshape(-1, 1)).view(num_tokens, self.top_k, -1)
        out = out.sum(dim=1).to(x.dtype)
        if self.parallel.tp_size > 1:
            out = all_reduce(out, self.parallel.tp_group)
        return out


def experts_by_group(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, expert_start: int) -> torch.Tensor:
    """The torch path: x [T, H], topk_ids [T, k] -> one output row per (token, slot)
    pair, [T * k, H], zero for pairs whose expert this rank does not hold.

    Pairs are sorted by expert once; each local expert with tokens then runs one
    gate/up matmul, SwiGLU and down matmul on its contiguous group. The counts are
    read on the host (a sync on CUDA), so this path is for the CPU.
    """
    num_local = w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=expert_start + num_local)
    starts = (torch.cumsum(counts, 0) - counts).tolist()
    counts = counts.tolist()
    out = x.new_zeros(flat.shape[0], x.shape[1])
    for local in range(num_local):
        expert = expert_start + local
        if counts[expert] == 0:
            continue
        pairs = order[starts[expert]:starts[expert] + counts[expert]]
        tokens = x[pairs // topk_ids.shape[1]]
        hidden = ops.silu_and_mul(F.linear(tokens, w13[local]))
        out[pairs] = F.linear(hidden, w2[local])
    return out


class SparseMoeBlock(nn.Module):
    """The MLP of a MoE decoder layer: a replicated router (`gate`, kept unquantized as
    in every MoE checkpoint) and the experts (`FusedMoE`'s arguments)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, parallel: ParallelContext = SINGLE,
                 **experts_options) -> None:
        super().__init__()
        self.gate = Router(num_experts, hidden_size, dtype)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                dtype, parallel, **experts_options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Router(nn.Module):
    """Router logits x W^T, W [E, H], the same on every rank (not sharded)."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(num_experts, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


# `model.layers.3.mlp.experts.5.gate_proj.weight` -> layer 3, expert 5.
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.")


def expert_held_elsewhere(model: nn.Module, name: str) -> bool:
    """True for the checkpoint tensor of an expert that another expert-parallel rank holds
    (so this rank never reads it). `model.model.layers` holds the decoder layers."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return False
    mlp = getattr(model.model.layers[int(match.group(1))], "mlp", None)
    experts = getattr(mlp, "experts", None)
    return isinstance(experts, FusedMoE) and not experts.holds_expert(int(match.group(2)))

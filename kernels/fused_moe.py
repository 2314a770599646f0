"""Mixture-of-experts experts as two grouped GEMMs over (token, slot) pairs sorted by expert.

    pairs p = t * k + slot, expert topk_ids[t, slot]; only experts [e0, e0 + E_local)
    of this rank count. `align_pairs` lays them out expert by expert, each expert's run
    padded to a multiple of BLOCK_M with the pad id P = T * k:

        sorted_ids   [e0 e0 e0 P | e1 P P P | e3 e3 e3 e3 | P ...]   (capacity fixed)
        block_expert [  0       |   1     |    3        | -1 ...]

    gate_up[p] = x[p // k] @ w13[e]^T     (one program: BLOCK_M pairs of one expert x
    out[p]     = silu_and_mul(gate_up[p]) @ w2[e]^T        BLOCK_N output columns)

Nothing here reads a count on the host: the capacity `T k + E_local (BLOCK_M - 1)`
bounds the padded length whatever the routing, and programs past the real length
(or on pad rows) do nothing. So the step runs inside a CUDA graph and costs no sync;
each expert's weights are read once per BLOCK_M of its pairs. Pairs of experts that
another rank holds get zero rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels._checks import FLOAT_DTYPES, check_tensor, dot_precision
from pagoda.kernels.activation import silu_and_mul

_BLOCK_M = 16


def align_pairs(topk_ids: torch.Tensor, expert_start: int, num_local: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [capacity], block_expert [capacity / block_m], padded_length [1]) as
    pictured above; all on topk_ids' device, computed without a host sync."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).long() - expert_start
    local = (flat >= 0) & (flat < num_local)
    bucket = torch.where(local, flat, num_local)  # other ranks' experts: one last bucket
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    first = torch.cumsum(counts, 0) - counts  # each bucket's first index in `order`
    rank_in_expert = torch.arange(num_pairs, device=device) - first[sorted_bucket]
    held = sorted_bucket < num_local
    expert = sorted_bucket.clamp(max=max(num_local - 1, 0))
    capacity = -(-(num_pairs + num_local * (block_m - 1)) // block_m) * block_m
    # Pairs of other ranks' experts land in a spare slot past the end, then dropped.
    dest = torch.where(held, padded_end[expert] - padded[expert] + rank_in_expert, capacity)
    sorted_ids = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1).to(torch.int32)
    return sorted_ids[:capacity], block_expert, padded_end[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
                         padded_length_ptr, num_pairs, N, K, a_rows_per_pair,
                         stride_am, stride_we, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(padded_length_ptr):
        return
    expert = tl.load(block_expert_ptr + block)
    pair = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    rows = (pair // a_rows_per_pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, aligned,
                  num_pairs: int, a_rows_per_pair: int) -> None:
    sorted_ids, block_expert, padded_length = aligned
    n, k = w.shape[1], w.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    _grouped_gemm_kernel[(block_expert.numel(), triton.cdiv(n, block_n))](
        a, w, out, sorted_ids, block_expert, padded_length, num_pairs, n, k, a_rows_per_pair,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=dot_precision(a.dtype))


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  expert_start: int) -> torch.Tensor:
    """Same contract as `pagoda.model.moe.experts_by_group`: x [T, H], topk_ids [T, k],
    w13 [E_local, 2I, H], w2 [E_local, H, I] -> [T * k, H], zero rows for pairs of
    experts this rank does not hold."""
    num_tokens, hidden = x.shape
    num_local, two_inter, _ = w13.shape
    check_tensor("x", x, (num_tokens, hidden), FLOAT_DTYPES)
    check_tensor("w13", w13, (num_local, two_inter, hidden), (x.dtype,))
    check_tensor("w2", w2, (num_local, hidden, two_inter // 2), (x.dtype,))
    check_tensor("topk_ids", topk_ids, (num_tokens, None), (torch.int32, torch.int64))
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
    if num_pairs == 0 or num_local == 0:
        return out
    aligned = align_pairs(topk_ids, expert_start, num_local, _BLOCK_M)
    gate_up = torch.zeros(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, aligned, num_pairs, top_k)
    _grouped_gemm(silu_and_mul(gate_up), w2, out, aligned, num_pairs, 1)
    return out

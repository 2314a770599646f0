"""Support for kernel checks (tests and benchmarks/gpu_check.py).

`random_paged_batch` lays requests out exactly as the model runner does (decodes
first, then prefills; blocks scattered at random over the cache so a kernel that
ignores the block table fails), fills each request's cached prefix with random K/V,
and returns this step's keys/values still to be written. `patch_triton_interpreter`
makes the CPU interpreter compute bf16 like the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.kernels.attention_metadata import AttentionMetadata


@dataclass
class PagedBatch:
    """One step: `query [T, H, D]`, this step's `key`/`value [T, Hkv, D]` (not yet in
    the cache), caches holding every request's cached prefix, and the metadata."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    attn_metadata: AttentionMetadata


def random_paged_batch(
    requests: list[tuple[int, int]],  # (num_cached_tokens, num_query_tokens), decodes first
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    extra_blocks: int = 3,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    q_lens = [q for _, q in requests]
    num_decodes = 0
    while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
        num_decodes += 1
    assert all(q != 1 for q in q_lens[num_decodes:]), "decodes (1 query token) must come first"
    seq_lens = [c + q for c, q in requests]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, start = [], [], 0
    for (cached, q_len), n in zip(requests, blocks_per_req):
        table = perm[start:start + n]
        start += n
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached, cached + q_len)]

    # Values are drawn on the target device: GPU-sized caches would take seconds on a CPU.
    dev_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = randn(*cache_shape), randn(*cache_shape)
    num_tokens = sum(q_lens)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    md = AttentionMetadata.build(slots, qsl, seq_lens, tables, num_decodes, device)
    return PagedBatch(
        query=randn(num_tokens, num_heads, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        key_cache=key_cache,
        value_cache=value_cache,
        attn_metadata=md,
    )


def patch_triton_interpreter() -> None:
    """Make the Triton CPU interpreter compute bf16 the way the GPU does.

    The interpreter (triton 3.9) keeps bf16 as raw uint16 and (1) multiplies those
    raw bits in `tl.dot`, and (2) truncates fp32 -> bf16 where the GPU rounds to
    nearest even. Both are interpreter defects, not kernel semantics: on the GPU a bf16
    dot multiplies exactly and accumulates in fp32, which is what fp32 operands
    reproduce. Call after setting `TRITON_INTERPRET=1`; idempotent.
    """
    # lazy: triton loads only where the interpreter runs (after TRITON_INTERPRET=1 is
    # set); `import pagoda.kernels.testing` stays free of triton.
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_pagoda_patched", False):
        return
    cast_impl, create_dot = builder.cast_impl, builder.create_dot

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round half to even
            return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    def dot_via_fp32(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = cast_impl(self, a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = cast_impl(self, b, tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.cast_impl = cast_rne
    builder.create_dot = dot_via_fp32
    builder._pagoda_patched = True


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e|: one number per check, comparable across dtypes."""
    expected = expected.float()
    scale = expected.abs().max().clamp_min(1e-6)
    return float((actual.float() - expected).abs().max() / scale)

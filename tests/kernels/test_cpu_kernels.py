"""Pagoda's fused C++ kernels for the bf16 CPU path (`pagoda.kernels.cpu`) against the
torch ops they replace: bit-equal where the torch chain is elementwise, within bf16
rounding where it reduces, per-row (batch invariant), and refusing out-of-range ids."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagoda.kernels import cpu as cpu_kernels
from pagoda.kernels.testing import random_paged_batch
from pagoda.model import attention, layers, ops, rotary

from cpu_kernel_guard import kernels_loaded, requires_compiler  # noqa: F401 (autouse)

BF16 = torch.bfloat16

pytestmark = requires_compiler


def _torch_rms_norm(x, w, eps, residual, unit_offset):
    with_kernels = cpu_kernels._loaded
    cpu_kernels._loaded = False
    try:
        return ops.rms_norm(x, w, eps, residual, unit_offset)
    finally:
        cpu_kernels._loaded = with_kernels


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 576), (3, 48), (2, 100)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_equals_the_torch_chain(rows, hidden, unit_offset):
    torch.manual_seed(rows * hidden)
    x, r = torch.randn(2, rows, hidden, dtype=BF16) * 3
    w = torch.randn(hidden, dtype=BF16)
    for residual in (None, r):
        got, got_sum = cpu_kernels.rms_norm(x, w, 1e-5, residual, unit_offset)
        want, want_sum = _torch_rms_norm(x, w, 1e-5, residual, unit_offset)
        assert torch.equal(got, want)
        assert torch.equal(got_sum, want_sum)
    assert cpu_kernels.rms_norm(x, w, 1e-5)[1] is x


def test_silu_and_mul_and_rotary_equal_the_torch_ops():
    torch.manual_seed(1)
    gate_up = torch.randn(5, 2, 3072, dtype=BF16) * 4  # leading dims kept; 16-lane + tail
    assert torch.equal(cpu_kernels.silu_and_mul(gate_up), layers.silu_and_mul(gate_up))
    odd = torch.randn(3, 2 * 37, dtype=BF16)
    assert torch.equal(cpu_kernels.silu_and_mul(odd), layers.silu_and_mul(odd))
    qkv = torch.randn(4, 15, 64, dtype=BF16)
    qk = qkv[:, :12]  # a strided view, as the fused projection's split gives
    rope = rotary.RotaryEmbedding(64, 10000.0, None, 256)
    cos, sin = rope(torch.tensor([0, 5, 77, 200]), BF16)
    assert torch.equal(cpu_kernels.rotary_embedding(qk, cos, sin), rotary.apply_rotary(qk, cos, sin))
    partial = rotary.RotaryEmbedding(64, 10000.0, None, 256, rotary_dim=32)
    cos, sin = partial(torch.tensor([1, 2, 3, 4]), BF16)
    assert torch.equal(cpu_kernels.rotary_embedding(qk, cos, sin), rotary.apply_rotary(qk, cos, sin))


def test_write_kv_cache_matches_and_refuses_slots_outside_the_cache():
    batch = random_paged_batch([(6, 1), (0, 5), (9, 4)], 6, 2, 64, 4, dtype=BF16, seed=3)
    md = batch.attn_metadata
    got = (batch.key_cache.clone(), batch.value_cache.clone())
    want = (batch.key_cache.clone(), batch.value_cache.clone())
    cpu_kernels.write_kv_cache(batch.key, batch.value, *got, md.slot_mapping)
    attention.write_kv_cache(batch.key, batch.value, *want, md.slot_mapping)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    num_slots = got[0].shape[0] * got[0].shape[1]
    for bad in (num_slots, -1):
        slots = md.slot_mapping.clone()
        slots[-1] = bad
        before = got[0].clone()
        with pytest.raises(RuntimeError, match="outside the cache"):
            cpu_kernels.write_kv_cache(batch.key, batch.value, *got, slots)
        assert torch.equal(got[0], before)  # checked before anything is written


def _dense_reference(query, key_cache, value_cache, tables, lens, scale, window, cap):
    """fp32 attention of each decode over its visible keys, gathered densely."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    outs = []
    for i, length in enumerate(lens.tolist()):
        ids = tables[i, :-(-length // block_size)].long()
        k = key_cache[ids].flatten(0, 1)[:length].float()
        v = value_cache[ids].flatten(0, 1)[:length].float()
        first = max(0, length - window) if window else 0
        k = k[first:].repeat_interleave(group, dim=1)
        v = v[first:].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", query[i].float(), k) * scale
        if cap:
            scores = cap * torch.tanh(scores / cap)
        outs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


@pytest.mark.parametrize("window,cap", [(None, None), (40, None), (None, 30.0), (7, 20.0)])
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: the scalar path (not 16-lane)
def test_decode_attention_matches_fp32_and_is_batch_invariant(window, cap, head_dim):
    torch.manual_seed(head_dim)
    num_blocks, block_size, kv_heads, heads = 48, 16, 3, 9
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=BF16)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=BF16)
    lens = torch.tensor([1, 17, 100, 33, 160], dtype=torch.int32)
    tables = torch.zeros(len(lens), 12, dtype=torch.int32)
    order, used = torch.randperm(num_blocks).int(), 0
    for i, length in enumerate(lens.tolist()):
        n = -(-length // block_size)
        tables[i, :n] = order[used:used + n]
        used += n
    query = torch.randn(len(lens), heads, head_dim, dtype=BF16)
    out = cpu_kernels.paged_decode_attention(query, key_cache, value_cache, tables, lens,
                                             head_dim ** -0.5, window, cap)
    want = _dense_reference(query, key_cache, value_cache, tables, lens, head_dim ** -0.5,
                            window, cap)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    for i in range(len(lens)):  # alone, each row is bit-identical to its row in the batch
        alone = cpu_kernels.paged_decode_attention(query[i:i + 1], key_cache, value_cache,
                                                   tables[i:i + 1], lens[i:i + 1],
                                                   head_dim ** -0.5, window, cap)
        assert torch.equal(alone[0], out[i])


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_decode_attention_splits_work_without_changing_a_bit(one_thread):
    """Batches of at least 4 sequences a thread run a task per sequence (whole cache
    rows), smaller ones a task per KV head: each row's result is the same bits."""
    torch.manual_seed(1)
    num_blocks, block_size, kv_heads, heads, head_dim = 96, 16, 2, 8, 64
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=BF16)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=BF16)
    lens = torch.tensor([1, 17, 100, 33, 160, 5, 64, 90], dtype=torch.int32)
    tables = torch.randperm(num_blocks).int()[:len(lens) * 10].reshape(len(lens), 10)
    query = torch.randn(len(lens), heads, head_dim, dtype=BF16)
    out = cpu_kernels.paged_decode_attention(query, key_cache, value_cache, tables, lens,
                                             0.125, None, None)
    want = _dense_reference(query, key_cache, value_cache, tables, lens, 0.125, None, None)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    for i in range(len(lens)):
        alone = cpu_kernels.paged_decode_attention(query[i:i + 1], key_cache, value_cache,
                                                   tables[i:i + 1], lens[i:i + 1], 0.125,
                                                   None, None)
        assert torch.equal(alone[0], out[i])


def test_decode_attention_refuses_ids_and_lengths_outside_the_cache():
    key_cache = torch.randn(4, 16, 1, 64, dtype=BF16)
    query = torch.randn(1, 2, 64, dtype=BF16)
    tables = torch.tensor([[0, 4]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id 4 outside the cache"):
        cpu_kernels.paged_decode_attention(query, key_cache, key_cache, tables,
                                           torch.tensor([20], dtype=torch.int32), 0.1, None, None)
    with pytest.raises(RuntimeError, match="length 33 outside"):
        cpu_kernels.paged_decode_attention(query, key_cache, key_cache, tables,
                                           torch.tensor([33], dtype=torch.int32), 0.1, None, None)


def test_ops_send_bf16_decodes_to_the_kernel_and_prefills_to_sdpa():
    batch = random_paged_batch([(30, 1), (70, 1), (0, 6), (12, 5)], 8, 2, 64, 16, dtype=BF16,
                               seed=5)
    md = batch.attn_metadata
    ops.write_kv_cache(batch.key, batch.value, batch.key_cache, batch.value_cache,
                       md.slot_mapping)
    got = ops.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, 0.125)
    want = attention.paged_attention(batch.query.float(), batch.key_cache.float(),
                                     batch.value_cache.float(), md, 0.125)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    prefill_rows = slice(md.num_decodes, None)  # unchanged: the same SDPA path as without
    plain = attention.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, 0.125)
    assert torch.equal(got[prefill_rows], plain[prefill_rows])


def test_switched_off_by_the_environment():
    code = ("import torch\n"
            "from pagoda.model import ops\n"
            "from pagoda.kernels import cpu\n"
            "x = torch.randn(2, 8, dtype=torch.bfloat16)\n"
            "ops.rms_norm(x, torch.ones(8, dtype=x.dtype), 1e-5, x)\n"
            "assert not cpu.available()\n"
            "try:\n"
            "    torch.ops.pagoda_cpu.rms_norm\n"
            "except AttributeError:\n"
            "    pass\n"
            "else:\n"
            "    raise AssertionError('the library was loaded')\n")
    env = {**os.environ, "PAGODA_CPU_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)

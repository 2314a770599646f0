"""Fused C++ kernels for the bf16 CPU path (`csrc/pagoda_cpu_ops.cpp`).

A decode step at a few rows is hundreds of small torch calls whose dispatch, allocation
and thread wake-ups cost more than the arithmetic; each function here does one chain of
them in one pass. `pagoda.model.ops` and `pagoda.model.attention` call them for bf16
tensors on the CPU when `available()`; everything else (fp32, fp16, CUDA, an fp8 KV
cache) keeps the torch path, which stays the reference the tests compare against.
Two more jobs live in their own headers: the skinny int4/int8 GEMV of GGUF 4-bit layers
and the Q8_0 head (`csrc/gemv.h`, read by `pagoda.model.quantization.gguf_int4`; its
AVX-512 code is picked at run time, its portable code gives the same bits) and the
sampler's exponential race (`csrc/race.h`, read by `pagoda.sample.sampler`).

Contracts are those of the torch functions they replace (same arguments, same result
up to the rounding of reductions, see the C++ file's header); every result row depends
on its own inputs alone, so the kernels are batch invariant.

`available()` loads the library on first use, compiling it if this machine has none
(`build.py`; `make install` does that ahead). PAGODA_CPU_KERNELS=0 turns them off; a
failed build logs one warning and leaves them off. The switch is read here, not
through `pagoda.envs` (which documents it): the kernels import no library code.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import torch

from pagoda.kernels.cpu import build

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet


def available() -> bool:
    """True when the kernels are loaded (compiling them first if needed)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
    return _loaded


def switched_on() -> bool:
    """PAGODA_CPU_KERNELS read as `pagoda.envs` reads a flag: unset or empty is on,
    "0"/"false"/"no"/"off" are off."""
    return os.environ.get("PAGODA_CPU_KERNELS", "").strip().lower() not in (
        "0", "false", "no", "off")


def _load() -> bool:
    if not switched_on():
        return False
    try:
        torch.ops.load_library(str(build.build()))
    except Exception as exc:  # noqa: BLE001 - any failure means the torch path
        logger.warning("Pagoda CPU kernels unavailable, using plain torch ops: %s", exc)
        return False
    return True


class _RawOps:
    """The library's ops as their C++ callables (`OpOverload._op`): the Python
    `torch.ops` wrappers cost several microseconds a call, about a norm's whole work."""

    def __init__(self) -> None:
        namespace = torch.ops.pagoda_cpu
        for name in ("rms_norm", "silu_and_mul", "rotary_embedding", "write_kv_cache",
                     "paged_decode_attention", "decode_layers", "int4_gemv", "int8_gemv",
                     "gemv_vector_isa", "race_argmax"):
            overload = getattr(namespace, name).default
            setattr(self, name, getattr(overload, "_op", overload))


@functools.cache
def _ops() -> _RawOps:
    """The op table, built on first use (after `available()` loaded the library); two
    threads that race here build equal tables, so no lock is needed."""
    return _RawOps()


def applies(t: torch.Tensor) -> bool:
    """True when calls on tensors like `t` go to these kernels."""
    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`pagoda.model.ops.rms_norm`: (norm(x + residual) * weight, x + residual)."""
    out, total = _ops().rms_norm(x, residual, weight, eps, unit_offset)
    return out, (x if residual is None else total)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up, [..., I]."""
    return _ops().silu_and_mul(gate_up)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`pagoda.model.rotary.apply_rotary`: x [T, heads, D] rotated, a new contiguous tensor."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _ops().rotary_embedding(x, cos.contiguous(), signed_sin.contiguous())


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`pagoda.model.attention.write_kv_cache`; a slot outside the cache raises."""
    _ops().write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                           logits_soft_cap: float | None) -> torch.Tensor:
    """Decode attention of query [N, H, D] (one token per sequence, at position
    seq_lens[i] - 1) straight over the paged caches -> [N, H, D]; sequence i's blocks
    are block_tables[i]. A block id or length outside the cache raises."""
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        block_tables, seq_lens = block_tables.to(torch.int32), seq_lens.to(torch.int32)
    return _ops().paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         scale, sliding_window or 0, logits_soft_cap or 0.0)


def decode_layers(hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                  signed_sin: torch.Tensor, weights: list[torch.Tensor],
                  key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                  slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  eps: float, scale: float, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama-shaped stack's decoder layers over one step of decodes, in one call: each
    layer the chain of the kernels above and torch's int4 product that the Python loop
    runs (`pagoda.model.cpu_decode_stack` says when it applies; the C++ file, what it
    computes). Returns (last MLP output, residual before it)."""
    return _ops().decode_layers(hidden, residual, cos, signed_sin, weights, key_caches,
                                value_caches, slot_mapping, block_tables, seq_lens, num_heads,
                                num_kv_heads, head_dim, eps, scale, group_size)


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              portable: bool = False) -> torch.Tensor:
    """x [M, K] bf16 times a 4-bit weight in gemv.h's layout (`gguf_int4.pack_int4_gemv`)
    -> [M, N] bf16; `portable` forces the scalar code (same bits as the AVX-512 code)."""
    return _ops().int4_gemv(x, packed, scales, 1 if portable else 0)


def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
              portable: bool = False) -> torch.Tensor:
    """x [M, K] bf16 times int8 weight [N, K] (K % 16 == 0) with per-row bf16 scales [N]
    -> [M, N] bf16 (`_weight_int8pack_mm`'s contract); `portable` as `int4_gemv`."""
    return _ops().int8_gemv(x, weight, scales, 1 if portable else 0)


def gemv_vector_isa() -> bool:
    """True when the gemv kernels run their AVX-512 BF16 code on this CPU."""
    return bool(_ops().gemv_vector_isa())


def race_argmax(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of fp32 logits [B, V] and uniforms U [B, V], argmax of l - ln(-ln U): the
    sampler's exponential race argmax(softmax(l) / -ln U) in one pass (csrc/race.h)."""
    return _ops().race_argmax(logits, uniforms)

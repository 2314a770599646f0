"""Paged KV cache tensors: one (key, value) pair per layer.

Each tensor is `[num_blocks, block_size, num_kv_heads, head_dim]` (see
`attention_metadata.py`), unless the architecture declares a latent cache
(`ModelArchConfig.kv_latent_dim`, multi-head latent attention): then the key tensor is
`[num_blocks, block_size, 1, kv_latent_dim]` and the value tensor is empty
(`[num_blocks, block_size, 1, 0]`, no bytes), so a block costs the latent alone and
the pair structure every caller walks stays the same (`layer_cache_spec`). Blocks are
zero-filled: attention gathers padded block-table entries and masks them, which is
only safe if they hold finite values.

Under parallelism a rank caches only its own share: the KV heads of its tensor-
parallel slice (`num_kv_heads / T`, or one replicated head when there are fewer KV
heads than ranks; a latent cache whole on every rank) for the layers of its pipeline
stage. Block ids mean the same on every rank, so one block table serves the whole group.

A hybrid model's Mamba2 layers (`ModelArchConfig.mamba`) hold no blocks: their pair is
the recurrent state pool instead, conv states `[num_state_slots, conv_dim, conv_kernel - 1]`
(cache dtype) and SSM states `[num_state_slots, num_heads, head_dim, state_size]`
(float32), one slot per running request (`AttentionMetadata.state_slots`); a block
then costs the attention layers alone.

The cache dtype is the model's, or float8_e4m3fn with `--kv-cache-dtype fp8` (CUDA
only; `fp8_kv_cache.py`), which halves a bf16 cache.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import (SINGLE, ParallelContext, num_local_heads,
                                              stage_layer_range)


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's cache on one rank: key `[blocks, block_size, num_heads, key_dim]`,
    value `[blocks, block_size, num_heads, value_dim]`; value_dim 0: keys only."""

    num_heads: int
    key_dim: int
    value_dim: int


def layer_cache_spec(arch: ModelArchConfig, parallel: ParallelContext | None = None,
                     layer_idx: int | None = None) -> KVCacheSpec:
    """What each layer of `arch` (or layer `layer_idx`) caches per token on a rank: its
    share of the KV heads' keys and values, the whole latent (MLA: replicated on every
    tensor-parallel rank, since every query head reads it), or nothing (a Mamba2 layer
    of a hybrid model: its state is per request, `recurrent_state_shapes`)."""
    if layer_idx is not None and is_recurrent_layer(arch, layer_idx):
        return KVCacheSpec(0, 0, 0)
    if arch.kv_latent_dim is not None:
        return KVCacheSpec(1, arch.kv_latent_dim, 0)
    num_kv_heads = num_local_heads(arch, (parallel or SINGLE).tp_size)[1]
    return KVCacheSpec(num_kv_heads, arch.head_dim, arch.head_dim)


def is_recurrent_layer(arch: ModelArchConfig, layer_idx: int) -> bool:
    """Whether layer `layer_idx` is a Mamba2 layer (recurrent state, no KV blocks)."""
    return arch.mamba is not None and layer_idx in arch.mamba.layers


def recurrent_state_shapes(arch: ModelArchConfig, num_state_slots: int
                           ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv state shape, SSM state shape) of one Mamba2 layer's pool of slots."""
    m = arch.mamba
    return ((num_state_slots, m.conv_dim, m.conv_kernel - 1),
            (num_state_slots, m.num_heads, m.head_dim, m.state_size))


def recurrent_state_bytes(arch: ModelArchConfig, num_state_slots: int, dtype: torch.dtype) -> int:
    """Bytes of every Mamba2 layer's state pool (0 for a model without any)."""
    if arch.mamba is None:
        return 0
    conv, ssm = recurrent_state_shapes(arch, num_state_slots)
    element_size = torch.empty((), dtype=dtype).element_size()
    per_layer = math.prod(conv) * element_size + math.prod(ssm) * 4
    return per_layer * len(arch.mamba.layers)


def _local_layers(arch: ModelArchConfig, parallel: ParallelContext | None) -> range:
    parallel = parallel or SINGLE
    start, end = stage_layer_range(arch.num_hidden_layers, parallel.pp_size, parallel.pp_rank)
    return range(start, end)


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype,
                             parallel: ParallelContext | None = None) -> int:
    """Bytes one block takes across this rank's layers, keys and values (or latents)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for i in _local_layers(arch, parallel):
        spec = layer_cache_spec(arch, parallel, i)
        total += block_size * spec.num_heads * (spec.key_dim + spec.value_dim) * element_size
    return total


def allocate_kv_caches(arch: ModelArchConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: str | torch.device,
                       parallel: ParallelContext | None = None, num_state_slots: int = 1
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (key_cache, value_cache) pair per layer this rank holds; a Mamba2
    layer's pair is its (conv, SSM) state pool of `num_state_slots` slots."""
    caches = []
    for i in _local_layers(arch, parallel):
        if is_recurrent_layer(arch, i):
            conv, ssm = recurrent_state_shapes(arch, num_state_slots)
            caches.append((torch.zeros(conv, dtype=dtype, device=device),
                           torch.zeros(ssm, dtype=torch.float32, device=device)))
            continue
        spec = layer_cache_spec(arch, parallel, i)
        shape = (num_blocks, block_size, spec.num_heads)
        caches.append((_zeros((*shape, spec.key_dim), dtype, device),
                       _zeros((*shape, spec.value_dim), dtype, device)))
    return caches


# Below this a cache tensor is allocated the usual way (the mapping's page rounding and
# the syscall are not worth it).
_LAZY_ZEROS_MIN_BYTES = 1 << 20


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device
           ) -> torch.Tensor:
    """A zero-filled cache tensor. On the CPU a large one is an anonymous memory mapping,
    which the kernel zero-fills page by page on first touch: `torch.zeros` writes every
    byte up front, which cost ~3.8 s of a 10-13 s start-up for the default model's 2 GiB
    cache on this 2-core machine, and commits the whole budget to RSS before one request
    needs it. The tensor holds the mapping (torch.frombuffer keeps the buffer alive); it
    is unmapped when the last view of the tensor goes."""
    element_size = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * element_size
    if torch.device(device).type != "cpu" or nbytes < _LAZY_ZEROS_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes)  # MAP_PRIVATE | MAP_ANONYMOUS: zero pages
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)


def resolve_kv_cache_dtype(kv_cache_dtype: str, device: str | torch.device) -> str:
    """vLLM's --kv-cache-dtype -> "auto" or "fp8"; ValueError for fp8 off CUDA."""
    name = kv_cache_dtype.lower()
    if name == "auto":
        return "auto"
    if name not in ("fp8", "fp8_e4m3"):
        raise ValueError(f"Unknown kv_cache_dtype {kv_cache_dtype!r}; expected auto, fp8 or "
                         "fp8_e4m3")
    if torch.device(device).type != "cuda":
        raise ValueError("--kv-cache-dtype fp8 needs a CUDA device: on the CPU the KV cache "
                         "keeps the model dtype (use --kv-cache-dtype auto)")
    return "fp8"


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache tensors for a resolved --kv-cache-dtype."""
    return torch.float8_e4m3fn if kv_cache_dtype == "fp8" else model_dtype

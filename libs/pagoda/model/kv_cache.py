"""Paged KV cache tensors: one (key, value) pair per layer.

Each tensor is `[num_blocks, block_size, num_kv_heads, head_dim]` (see
`attention_metadata.py`). Blocks are zero-filled: attention gathers padded
block-table entries and masks them, which is only safe if they hold finite values.

Under parallelism a rank caches only its own share: the KV heads of its tensor-
parallel slice (`num_kv_heads / T`, or one replicated head when there are fewer KV
heads than ranks) for the layers of its pipeline stage. Block ids mean the same
on every rank, so one block table serves the whole group.

The cache dtype is the model's, or float8_e4m3fn with `--kv-cache-dtype fp8` (CUDA
only; `fp8_kv_cache.py`), which halves a bf16 cache.
"""

from __future__ import annotations

import torch

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import (SINGLE, ParallelContext, num_local_heads,
                                              stage_layer_range)


def _local_shape(arch: ModelArchConfig, parallel: ParallelContext | None) -> tuple[int, int]:
    """(KV heads per layer, layers) this rank caches."""
    parallel = parallel or SINGLE
    start, end = stage_layer_range(arch.num_hidden_layers, parallel.pp_size, parallel.pp_rank)
    return num_local_heads(arch, parallel.tp_size)[1], end - start


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype,
                             parallel: ParallelContext | None = None) -> int:
    """Bytes one block takes across this rank's layers, keys and values."""
    num_kv_heads, num_layers = _local_shape(arch, parallel)
    element_size = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * num_kv_heads * arch.head_dim * element_size
    return per_layer * num_layers


def allocate_kv_caches(arch: ModelArchConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: str | torch.device,
                       parallel: ParallelContext | None = None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (key_cache, value_cache) pair per layer this rank holds."""
    num_kv_heads, num_layers = _local_shape(arch, parallel)
    shape = (num_blocks, block_size, num_kv_heads, arch.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


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

"""Paged KV cache tensors: one (key, value) pair per layer.

Each tensor is `[num_blocks, block_size, num_kv_heads, head_dim]` (see
`attention_metadata.py`). Blocks are zero-filled: attention gathers padded
block-table entries and masks them, which is only safe if they hold finite values.
"""

from __future__ import annotations

import torch

from pagoda.config import ModelArchConfig


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    element_size = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * arch.num_key_value_heads * arch.head_dim * element_size
    return per_layer * arch.num_hidden_layers


def allocate_kv_caches(arch: ModelArchConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: str | torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (key_cache, value_cache) pair per layer."""
    shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(arch.num_hidden_layers)]

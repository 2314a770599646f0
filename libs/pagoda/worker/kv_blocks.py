"""Read and write whole KV blocks by id: what a disaggregated transfer moves.

The worker's cache is, per layer, a key and a value tensor of shape
`[num_blocks, block_size, num_kv_heads, head_dim]` (pagoda.model.kv_cache). One
block's bytes are, layer by layer, its key rows then its value rows:

    [ L0.k[b] | L0.v[b] | L1.k[b] | L1.v[b] | ... ]   raw, in the cache's dtype

so a block exported by one worker imports into another with an equal layout
(`kv_layout`) byte for byte, on CPU or GPU. No transport here (libs/pagoda imports
no grpc): the gRPC transport lives in pagoda.services.gpu_worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LAYOUT = "blocks_tokens_heads_dim"


def _tensors(kv_caches: Sequence) -> list[torch.Tensor]:
    return [t for layer in kv_caches for t in layer]


def kv_layout(kv_caches: Sequence) -> dict:
    """num_layers, num_kv_heads, head_dim, block_size, num_blocks, kv_dtype."""
    key = kv_caches[0][0]
    num_blocks, block_size, num_kv_heads, head_dim = key.shape
    return {"num_layers": len(kv_caches), "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "block_size": block_size, "num_blocks": num_blocks,
            "kv_dtype": str(key.dtype).removeprefix("torch."), "layout": LAYOUT}


def block_nbytes(kv_caches: Sequence) -> int:
    """Bytes of one block across every layer."""
    return sum(t[0].numel() * t.element_size() for t in _tensors(kv_caches))


def export_block(kv_caches: Sequence, block_id: int) -> bytes:
    """One block's KV as bytes (see the module doc for the order)."""
    parts = [t[block_id].reshape(-1).view(torch.uint8) for t in _tensors(kv_caches)]
    return torch.cat(parts).cpu().numpy().tobytes()


def import_block(kv_caches: Sequence, block_id: int, data: bytes) -> None:
    """Write `data` (from `export_block` of an equal layout) into block `block_id`;
    ValueError if its size is not one block's."""
    tensors = _tensors(kv_caches)
    expected = sum(t[0].numel() * t.element_size() for t in tensors)
    if len(data) != expected:
        raise ValueError(f"a KV block is {expected} bytes here, got {len(data)}")
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    offset = 0
    for t in tensors:
        n = t[0].numel() * t.element_size()
        rows = buffer[offset:offset + n].view(t.dtype).view(t[0].shape)
        t[block_id].copy_(rows, non_blocking=False)
        offset += n


def import_blocks(kv_caches: Sequence, block_ids: Sequence[int], datas: Sequence[bytes]) -> None:
    """`import_block` for many blocks at once: one indexed copy per cache tensor instead
    of one per tensor and block (what a pull of a long prompt spends its time on).
    ValueError, with nothing written, if any block's size is not one block's."""
    if not block_ids:
        return
    tensors = _tensors(kv_caches)
    expected = sum(t[0].numel() * t.element_size() for t in tensors)
    if len(block_ids) != len(datas) or any(len(d) != expected for d in datas):
        raise ValueError(f"a KV block is {expected} bytes here; got "
                         f"{sorted({len(d) for d in datas})} for {len(block_ids)} ids")
    rows = torch.frombuffer(bytearray(b"".join(datas)), dtype=torch.uint8)
    rows = rows.view(len(datas), expected)
    index = torch.tensor(list(block_ids), dtype=torch.long)
    offset = 0
    for t in tensors:
        n = t[0].numel() * t.element_size()
        part = rows[:, offset:offset + n].contiguous().view(t.dtype).view(len(datas),
                                                                          *t.shape[1:])
        t.index_copy_(0, index.to(t.device), part.to(t.device))
        offset += n

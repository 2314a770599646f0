"""A KV block's bytes whatever the worker group's shape: what lets prefill TP differ
from decode TP.

On the wire a block is always the whole model's KV for that block, layer by layer
(every layer of the model, every KV head), its key rows then its value rows:

    [ L0.k[b] | L0.v[b] | L1.k[b] | ... ]   each [block_size, num_kv_heads, head_dim]

which is byte for byte what a single-rank worker's cache holds (kv_blocks.py). A rank
of a T x P group holds a share of it: the layers of its pipeline stage and the KV
heads of its tensor-parallel slice (kv_cache.py). `read_share` takes a rank's share
of some blocks out of its cache, `assemble` puts every rank's share into whole
blocks, `write_share` writes a rank's share of whole blocks into its cache. So a
TP=1 prefill worker feeds a TP=2 decode group, and any T x P to any other, as long
as the model (layers, KV heads, head size), dtype and block size agree.

With fewer KV heads than TP ranks, several ranks hold the same head; any of them
gives it (`assemble` writes each share, equal copies overwrite each other).

A latent cache (multi-head latent attention, `ModelArchConfig.kv_latent_dim`) has one
part per layer, not two: the latent rows `[block_size, 1, kv_latent_dim]` (its value
tensor holds no bytes, kv_cache.py), so a block on the wire is

    [ L0.latent[b] | L1.latent[b] | ... ]

and every tensor-parallel rank holds the whole latent (one "head", replicated). Its
layout name (`LATENT_LAYOUT`) and head size (the latent's) travel in the P/D handshake,
so a latent cache never meets a K/V cache or a latent of another size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.distributed.parallel_state import (kv_head_start, rank_coordinates,
                                              stage_layer_range)

LAYOUT = "blocks_tokens_heads_dim"  # KvLayout.layout: the cache tensors' dimension order
LATENT_LAYOUT = "blocks_tokens_latent"  # KvLayout.layout of a latent cache (keys only)


@dataclass(frozen=True)
class BlockShape:
    """The whole model's KV for one block: `num_layers` x `num_parts` (key and value: 2;
    a latent cache's latent alone: 1) x [block_size, num_kv_heads, head_dim] of `dtype`."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_parts: int = 2

    @property
    def layout(self) -> str:
        """KvLayout.layout: what the two sides of a transfer must agree on."""
        return LAYOUT if self.num_parts == 2 else LATENT_LAYOUT

    @property
    def nbytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return (self.num_layers * self.num_parts * self.block_size * self.num_kv_heads
                * self.head_dim * element)

    def blocks(self, data: bytes | bytearray | memoryview, count: int) -> torch.Tensor:
        """`count` blocks' bytes as [count, layers, parts, block_size, heads, head_dim];
        ValueError unless `data` is exactly `count` blocks."""
        if len(data) != count * self.nbytes:
            raise ValueError(f"a KV block is {self.nbytes} bytes here; got {len(data)} bytes "
                             f"for {count} blocks")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if count else \
            torch.empty(0, dtype=torch.uint8)
        return raw.view(self.dtype).view(self.dims(count))

    def dims(self, count: int) -> tuple[int, ...]:
        """[count, layers, parts, block_size, heads, head_dim]."""
        return (count, self.num_layers, self.num_parts, self.block_size, self.num_kv_heads,
                self.head_dim)

    def check(self, blocks: torch.Tensor, count: int) -> None:
        """ValueError unless `blocks` is `count` whole blocks of this shape and dtype."""
        if tuple(blocks.shape) != self.dims(count) or blocks.dtype != self.dtype:
            raise ValueError(f"expected {count} KV blocks of {self.dims(1)[1:]} "
                             f"{self.dtype}; got {tuple(blocks.shape)} {blocks.dtype}")


@dataclass(frozen=True)
class RankShare:
    """The part of every block one rank caches: layers [layer_start, layer_end) and
    KV heads [head_start, head_start + num_heads)."""

    layer_start: int
    layer_end: int
    head_start: int
    num_heads: int


def rank_share(num_layers: int, num_kv_heads: int, tp_size: int, pp_size: int,
               rank: int) -> RankShare:
    """What global rank `rank` of a `tp_size` x `pp_size` group caches."""
    pp_rank, tp_rank = rank_coordinates(rank, tp_size)
    start, end = stage_layer_range(num_layers, pp_size, pp_rank)
    heads = max(1, num_kv_heads // tp_size)
    return RankShare(start, end, kv_head_start(num_kv_heads, tp_size, tp_rank), heads)


def cached_parts(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A layer's cache tensors that hold bytes: (key, value), or (latent,) for a latent
    cache, whose value tensor is empty by construction (kv_cache.layer_cache_spec)."""
    return (key,) if value.shape[-1] == 0 else (key, value)


def read_share(kv_caches: Sequence, block_ids: Sequence[int]) -> torch.Tensor:
    """This rank's share of `block_ids`, on the cache's device:
    [len(block_ids), local layers, parts, block_size, local heads, head_dim]."""
    key = kv_caches[0][0]
    index = torch.tensor(list(block_ids), dtype=torch.long, device=key.device)
    per_layer = [torch.stack([t.index_select(0, index) for t in cached_parts(k, v)], dim=1)
                 for k, v in kv_caches]
    return torch.stack(per_layer, dim=1)


def assemble(shape: BlockShape, shares: Sequence[tuple[RankShare, torch.Tensor]],
             count: int) -> torch.Tensor:
    """Whole blocks [count, layers, parts, block_size, heads, head_dim] from every rank's
    `read_share`; ValueError if some layer or head is in no share."""
    out = torch.empty(shape.dims(count), dtype=shape.dtype)
    covered = torch.zeros(shape.num_layers, shape.num_kv_heads, dtype=torch.bool)
    for share, data in shares:
        heads = slice(share.head_start, share.head_start + share.num_heads)
        out[:, share.layer_start:share.layer_end, :, :, heads] = data
        covered[share.layer_start:share.layer_end, heads] = True
    if not bool(covered.all()):
        raise ValueError("the ranks' shares do not cover every layer and KV head")
    return out


def write_share(kv_caches: Sequence, block_ids: Sequence[int], blocks: torch.Tensor,
                share: RankShare) -> None:
    """Write this rank's share of whole `blocks` (`BlockShape.blocks`) into `block_ids`:
    one indexed copy per cache tensor."""
    if not block_ids:
        return
    key = kv_caches[0][0]
    index = torch.tensor(list(block_ids), dtype=torch.long, device=key.device)
    heads = slice(share.head_start, share.head_start + share.num_heads)
    mine = blocks[:, share.layer_start:share.layer_end, :, :, heads]
    for layer, (k, v) in enumerate(kv_caches):
        for part, tensor in enumerate(cached_parts(k, v)):
            tensor.index_copy_(0, index, mine[:, layer, part].contiguous().to(tensor.device))



def runner_geometry(runner) -> tuple[BlockShape, int] | None:
    """(whole block's shape, blocks in the cache) of a model runner of any rank, or
    None before its KV cache is allocated. A latent cache's block is one latent part of
    one "head" per layer. NotImplementedError for a hybrid model (Mamba2 layers): its
    blocks do not hold the recurrent state."""
    arch = runner.config.arch
    if arch.mamba is not None:
        raise NotImplementedError(
            f"{arch.architecture} is a hybrid model with Mamba2 layers whose recurrent state "
            "lives outside the KV blocks: moving its KV blocks (P/D disaggregation, the prefix "
            "pull) is not supported; serve it without a KV transfer (a single prefill+decode "
            "worker; a migrated request recomputes its whole context on the new replica)")
    if not runner.kv_caches:
        return None
    if arch.kv_latent_dim is not None:
        shape = BlockShape(arch.num_hidden_layers, runner.block_size, 1, arch.kv_latent_dim,
                           runner.kv_cache_dtype, num_parts=1)
    else:
        shape = BlockShape(arch.num_hidden_layers, runner.block_size, arch.num_key_value_heads,
                           arch.head_dim, runner.kv_cache_dtype)
    return shape, runner.kv_caches[0][0].shape[0]


def block_heads(arch) -> int:
    """The "heads" of a whole block: the model's KV heads, or 1 for a latent cache."""
    return 1 if arch.kv_latent_dim is not None else arch.num_key_value_heads


def runner_share(runner) -> RankShare:
    """The share of every block `runner` (one rank of its group) caches."""
    arch, parallel = runner.config.arch, runner.parallel
    return rank_share(arch.num_hidden_layers, block_heads(arch), parallel.tp_size,
                      parallel.pp_size, parallel.rank)


def check_block_ids(block_ids: Sequence[int], num_blocks: int) -> None:
    """ValueError naming the first id outside [0, num_blocks)."""
    for block_id in block_ids:
        if not 0 <= block_id < num_blocks:
            raise ValueError(f"no KV block {block_id} (the cache has {num_blocks})")


def as_bytes(blocks: torch.Tensor) -> bytes:
    """A tensor's raw bytes (any dtype, bf16 and fp8 included; any device)."""
    return blocks.contiguous().view(torch.uint8).cpu().numpy().tobytes()

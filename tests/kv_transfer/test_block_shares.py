"""A block travels whole (every layer and KV head); each rank of a T x P group reads
and writes only its share, so a prefill group of one shape feeds a decode group of
another and the decode side's cache holds exactly what the model would have computed."""

from __future__ import annotations

import pytest
import torch

from pagoda.kv_transfer.block_shares import (BlockShape, as_bytes, assemble, check_block_ids,
                                             rank_share, read_share, write_share)

LAYERS, BS, HEADS, DIM, BLOCKS = 4, 4, 4, 8, 6
SHAPE = BlockShape(LAYERS, BS, HEADS, DIM, torch.bfloat16)


def whole_cache() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A single-rank cache: every layer, every KV head."""
    return [(torch.randn(BLOCKS, BS, HEADS, DIM).to(torch.bfloat16),
             torch.randn(BLOCKS, BS, HEADS, DIM).to(torch.bfloat16)) for _ in range(LAYERS)]


def split(cache, tp: int, pp: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each rank's cache as the model would have filled it under T x P."""
    ranks = []
    for rank in range(tp * pp):
        share = rank_share(LAYERS, HEADS, tp, pp, rank)
        heads = slice(share.head_start, share.head_start + share.num_heads)
        ranks.append([(k[:, :, heads].clone(), v[:, :, heads].clone())
                      for k, v in cache[share.layer_start:share.layer_end]])
    return ranks


def test_one_rank_block_bytes_are_layer_by_layer_key_then_value():
    cache = whole_cache()
    data = as_bytes(read_share(cache, [2]))
    assert len(data) == SHAPE.nbytes
    expected = b"".join(as_bytes(t[2]) for layer in cache for t in layer)
    assert data == expected


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2), (8, 1)])  # (8, 1): heads replicated
def test_a_groups_shares_assemble_into_the_whole_blocks(tp, pp):
    cache = whole_cache()
    ranks = split(cache, tp, pp)
    ids = [5, 0, 3]
    shares = [(rank_share(LAYERS, HEADS, tp, pp, r), read_share(ranks[r], ids))
              for r in range(tp * pp)]
    assert torch.equal(assemble(SHAPE, shares, len(ids)), read_share(cache, ids))


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2), (8, 1)])
def test_whole_blocks_written_into_a_group_equal_what_it_would_have_computed(tp, pp):
    source = whole_cache()
    blocks = SHAPE.blocks(as_bytes(read_share(source, [1, 4])), 2)
    target = split([(torch.zeros_like(k), torch.zeros_like(v)) for k, v in source], tp, pp)
    for r, cache in enumerate(target):
        write_share(cache, [3, 0], blocks, rank_share(LAYERS, HEADS, tp, pp, r))
    expected = split(source, tp, pp)
    for mine, want in zip(target, expected):
        for (k, v), (wk, wv) in zip(mine, want):
            assert torch.equal(k[3], wk[1]) and torch.equal(v[0], wv[4])
            assert not k[1].any() and not v[2].any()  # only the target blocks were written


def test_shares_that_miss_a_head_are_refused():
    cache = whole_cache()
    share = rank_share(LAYERS, HEADS, 2, 1, 0)  # rank 1 (the other heads) is missing
    with pytest.raises(ValueError, match="cover"):
        assemble(SHAPE, [(share, read_share(split(cache, 2, 1)[0], [0]))], 1)


def test_bytes_of_another_size_and_ids_outside_the_cache_are_refused():
    with pytest.raises(ValueError, match="bytes"):
        SHAPE.blocks(b"\0" * (SHAPE.nbytes - 2), 1)
    with pytest.raises(ValueError, match="no KV block 6"):
        check_block_ids([0, 6], BLOCKS)


# ---------------------------------------------------------------- latent (MLA) blocks
LATENT = 24
LATENT_SHAPE = BlockShape(LAYERS, BS, 1, LATENT, torch.float32, num_parts=1)


def latent_cache() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A latent cache as kv_cache.allocate_kv_caches builds it: the latent rows and an
    empty value tensor per layer; every tensor-parallel rank holds all of it."""
    return [(torch.randn(BLOCKS, BS, 1, LATENT), torch.empty(BLOCKS, BS, 1, 0))
            for _ in range(LAYERS)]


def test_a_latent_block_is_each_layers_latent_rows():
    cache = latent_cache()
    data = as_bytes(read_share(cache, [2]))
    assert len(data) == LATENT_SHAPE.nbytes == LAYERS * BS * LATENT * 4  # no value bytes
    assert data == b"".join(as_bytes(latent[2]) for latent, _ in cache)
    assert (LATENT_SHAPE.layout, SHAPE.layout) == ("blocks_tokens_latent",
                                                    "blocks_tokens_heads_dim")


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_latent_blocks_move_between_groups_of_any_shape(tp, pp):
    """Each rank of a T x P group holds its stage's layers of the whole latent: the
    shares assemble into the source's bytes, and written back they fill every rank."""
    source = latent_cache()
    ids = [4, 1]
    shares = []
    for rank in range(tp * pp):
        share = rank_share(LAYERS, 1, tp, pp, rank)
        assert (share.head_start, share.num_heads) == (0, 1)  # replicated on every TP rank
        mine = source[share.layer_start:share.layer_end]
        shares.append((share, read_share(mine, ids)))
    blocks = assemble(LATENT_SHAPE, shares, len(ids))
    assert as_bytes(blocks) == as_bytes(read_share(source, ids))
    for rank in range(tp * pp):
        share = rank_share(LAYERS, 1, tp, pp, rank)
        target = [(torch.zeros(BLOCKS, BS, 1, LATENT), torch.empty(BLOCKS, BS, 1, 0))
                  for _ in range(share.layer_end - share.layer_start)]
        write_share(target, [0, 5], LATENT_SHAPE.blocks(as_bytes(blocks), 2), share)
        for (latent, _), (want, _) in zip(target, source[share.layer_start:share.layer_end]):
            assert torch.equal(latent[0], want[4]) and torch.equal(latent[5], want[1])
            assert not latent[1:5].any()

"""Chained, seeded prefix-cache block hashes: one function for the whole cluster.

    hash(block i) = sha256(seed_hash(i == 0) | parent hash, token ids, extra keys)

The hash of a full block depends on every token before it, so equal hashes mean
equal prefixes (up to sha256 collisions, which the block pool still guards
against by comparing stored token ids on a hit). The seed is a configured string,
never random: the tokenizer service computes the same hashes as the scheduler,
which is what makes KV-aware routing possible.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NewType, Sequence

BlockHash = NewType("BlockHash", bytes)


def root_hash(seed: str) -> BlockHash:
    """The parent hash of a sequence's first block."""
    return BlockHash(hashlib.sha256(b"pagoda-root:" + seed.encode()).digest())


def hash_block_tokens(
    parent_hash: BlockHash,
    token_ids: Sequence[int],
    extra_keys: Sequence[object] | None = None,
) -> BlockHash:
    """Hash one full block given its parent's hash (the root hash for block 0)."""
    h = hashlib.sha256(parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(tuple(extra_keys)).encode())
    return BlockHash(h.digest())


def request_keys(cache_salt: str | None, lora_key: str | None = None) -> tuple | None:
    """The extra keys of a request's blocks: its cache salt and its LoRA adapter's key
    (`LoRARequest.cache_key`, name and id), so the same prompt under two salts, two
    adapters, or an adapter and the base model never shares cached KV. The adapter is
    tagged so its key can never equal a salt. Every hasher (the scheduler's requests,
    the tokenizer's routing hashes, the KV transfer's checks) goes through this, so a
    request is keyed the same way everywhere."""
    keys = (cache_salt,) if cache_salt else ()
    if lora_key:
        keys += (("lora", lora_key),)
    return keys or None


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    seed: str,
    extra_keys: Sequence[object] | None = None,
    start_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block has none).

    `start_hashes` are already-known hashes of the leading blocks, so a growing
    sequence only hashes its new full blocks.
    """
    hashes = list(start_hashes)
    parent = hashes[-1] if hashes else root_hash(seed)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes

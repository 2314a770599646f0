"""Chained, seeded prefix-cache block hashes: one function for the whole cluster.

    hash(block i) = sha256(seed_hash(i == 0) | parent hash, token ids, extra keys)

The hash of a full block depends on every token before it, so equal hashes mean
equal prefixes (up to sha256 collisions, which the block pool still guards
against by comparing stored token ids on a hit). The seed is a configured string,
never random: the tokenizer service computes the same hashes as the scheduler,
which is what makes KV-aware routing possible.

The algorithm is `--prefix-caching-hash-algo` (vLLM's flag), the same on every
service (the gateway's start-up probe compares the tokenizer's and each
scheduler's hashes):

* `pagoda` (the default): the scheme above, seeded with `pagoda-root:<seed>`.
* `sha256`: vLLM's `sha256`, sha256 of `pickle.dumps((parent, tuple(token_ids),
  extra_keys), protocol=pickle.HIGHEST_PROTOCOL)`.
* `sha256_cbor`: vLLM's `sha256_cbor`, sha256 of the canonical CBOR of the same
  triple: language-neutral, what llm-d's kv-cache indexer recomputes.

For vLLM's two, the first block's parent is vLLM's NONE_HASH: vLLM computes it as
`hash_fn(os.environ["PYTHONHASHSEED"])` (a random value when that is unset, so
no two processes agree); here it is `hash_fn(seed)` with the configured
`--prefix-cache-hash-seed` string, so set that equal to the PYTHONHASHSEED of the
vLLM pods / the llm-d indexer's hash seed. vLLM's xxhash variants are refused.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from typing import Any, NewType, Sequence

import cbor2

BlockHash = NewType("BlockHash", bytes)

DEFAULT_HASH_ALGO = "pagoda"
HASH_ALGOS = ("pagoda", "sha256", "sha256_cbor")
# vLLM's choices that Pagoda does not implement (their serialisation has changed
# between vLLM releases): refused with a clear error rather than hashed differently.
UNSUPPORTED_HASH_ALGOS = ("xxhash", "xxhash_cbor")


def check_hash_algo(algo: str) -> str:
    """`algo` if Pagoda implements it, else a ValueError naming the choices."""
    if algo in HASH_ALGOS:
        return algo
    why = (" (vLLM's xxhash variants are not implemented by Pagoda)"
           if algo in UNSUPPORTED_HASH_ALGOS else "")
    raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}; "
                     f"got {algo!r}{why}")


def _vllm_sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _vllm_sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_VLLM_HASH_FNS = {"sha256": _vllm_sha256, "sha256_cbor": _vllm_sha256_cbor}


def root_hash(seed: str, algo: str = DEFAULT_HASH_ALGO) -> BlockHash:
    """The parent hash of a sequence's first block (vLLM's NONE_HASH for its algos)."""
    if algo == DEFAULT_HASH_ALGO:
        return BlockHash(hashlib.sha256(b"pagoda-root:" + seed.encode()).digest())
    return BlockHash(_VLLM_HASH_FNS[check_hash_algo(algo)](seed))


def hash_block_tokens(
    parent_hash: BlockHash,
    token_ids: Sequence[int],
    extra_keys: Sequence[object] | None = None,
    algo: str = DEFAULT_HASH_ALGO,
) -> BlockHash:
    """Hash one full block given its parent's hash (the root hash for block 0)."""
    if algo != DEFAULT_HASH_ALGO:
        keys = tuple(extra_keys) if extra_keys else None
        return BlockHash(_VLLM_HASH_FNS[check_hash_algo(algo)](
            (parent_hash, tuple(token_ids), keys)))
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


def mm_block_keys(mm_features: Sequence[Any], start: int, end: int) -> tuple[str, ...]:
    """The identifiers of the media items whose placeholder runs overlap token positions
    [start, end), in prompt order (vLLM's per-block multi-modal extra keys): a block
    whose tokens are an image's placeholders is keyed by that image's content hash, so
    equal placeholder tokens of different images never share KV."""
    return tuple(f.identifier for f in mm_features if f.offset < end and start < f.offset + f.length)


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    seed: str,
    extra_keys: Sequence[object] | None = None,
    start_hashes: Sequence[BlockHash] = (),
    algo: str = DEFAULT_HASH_ALGO,
    mm_features: Sequence[Any] = (),
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block has none).

    `start_hashes` are already-known hashes of the leading blocks, so a growing
    sequence only hashes its new full blocks. `mm_features` (`MultiModalFeature`s of
    the prompt) add, to each block they overlap, their identifiers after the request's
    own `extra_keys`; a block no item overlaps is hashed exactly as without media.
    """
    hashes = list(start_hashes)
    parent = hashes[-1] if hashes else root_hash(seed, algo)
    base = tuple(extra_keys) if extra_keys else ()
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        keys = extra_keys
        if mm_features:
            media = mm_block_keys(mm_features, start, start + block_size)
            keys = (base + media) if media else extra_keys
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], keys, algo)
        hashes.append(parent)
    return hashes

"""The start-up self-check: the tokenizer and each scheduler hash blocks alike.

KV-aware routing looks up the tokenizer's block hashes in an index the
schedulers fill with their own. If the two disagree (another seed, another
block size, another version of the hashing code) every lookup silently misses
and routing quietly degrades to load only: the failure users of other routers
report most. So before a replica gets traffic, both hash the same probe prompt,
with and without a cache salt, and must agree exactly.
"""

from __future__ import annotations

import grpc

from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb

PROBE_BLOCKS = 3
PROBE_SALT = "pagoda-hash-check"


def probe_token_ids(block_size: int, vocab_size: int) -> list[int]:
    """A fixed prompt of PROBE_BLOCKS full blocks plus a partial one."""
    n = PROBE_BLOCKS * block_size + block_size // 2
    return [(7919 * i + 13) % max(vocab_size, 1) for i in range(n)]


async def check_block_hashes(tokenizer_stub, scheduler_stub, info: spb.GetModelInfoResponse,
                             vocab_size: int) -> str | None:
    """None if they agree, else what differs. Raises grpc.RpcError when a peer could
    not answer now (check again later); a peer without HashBlocks is a mismatch."""
    token_ids = probe_token_ids(info.block_size, vocab_size)
    for salt in ("", PROBE_SALT):
        request = cpb.HashBlocksRequest(token_ids=token_ids, block_size=info.block_size,
                                        cache_salt=salt)
        try:
            ours = await tokenizer_stub.HashBlocks(request, timeout=5.0)
            theirs = await scheduler_stub.HashBlocks(request, timeout=5.0)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return "a peer does not implement HashBlocks (mixed Pagoda versions?)"
            raise
        if list(ours.block_hashes) != list(theirs.block_hashes):
            return (f"block hashes differ from the tokenizer's (salt {salt!r}; seeds: "
                    f"tokenizer {ours.prefix_hash_seed!r}, scheduler "
                    f"{theirs.prefix_hash_seed!r}; block size {info.block_size}): "
                    f"KV-aware routing would never find a cached prefix. Give every "
                    f"service the same --prefix-cache-hash-seed and Pagoda version")
    return None

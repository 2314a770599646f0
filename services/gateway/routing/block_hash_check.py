"""The start-up self-check: the tokenizer and each scheduler hash blocks alike.

KV-aware routing looks up the block hashes the tokenizer returns with each
tokenization in an index the schedulers fill with their own. If the two disagree (another seed, another
block size, another version of the hashing code) every lookup silently misses
and routing quietly degrades to load only: the failure users of other routers
report most. So before a replica gets traffic, both hash the same probe prompt,
with and without a cache salt and a LoRA adapter's key (the tokenizer through
`Tokenize`, the path routing uses; the scheduler through `HashBlocks`), and must
agree exactly.
"""

from __future__ import annotations

import grpc

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb

PROBE_BLOCKS = 3
PROBE_SALT = "pagoda-hash-check"
PROBE_LORA_KEY = "pagoda-hash-check:1"  # a LoRA adapter's key (LoRARequest.cache_key)


def probe_token_ids(block_size: int, vocab_size: int) -> list[int]:
    """A fixed prompt of PROBE_BLOCKS full blocks plus a partial one."""
    n = PROBE_BLOCKS * block_size + block_size // 2
    return [(7919 * i + 13) % max(vocab_size, 1) for i in range(n)]


async def check_block_hashes(tokenizer_stub, scheduler_stub, info: spb.GetModelInfoResponse,
                             tokenizer_info: tpb.GetTokenizerInfoResponse) -> str | None:
    """None if they agree, else what differs. Raises grpc.RpcError when a peer could
    not answer now (check again later); a scheduler without HashBlocks is a mismatch."""
    token_ids = probe_token_ids(info.block_size, tokenizer_info.vocab_size)
    for salt, lora_key in (("", ""), (PROBE_SALT, ""), (PROBE_SALT, PROBE_LORA_KEY)):
        try:
            ours = await tokenizer_stub.Tokenize(tpb.TokenizeRequest(
                token_ids=tpb.TokenIds(token_ids=token_ids), block_size=info.block_size,
                cache_salt=salt, lora_key=lora_key), timeout=5.0)
            theirs = await scheduler_stub.HashBlocks(spb.HashBlocksRequest(
                token_ids=token_ids, block_size=info.block_size, cache_salt=salt,
                lora_key=lora_key), timeout=5.0)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return "the scheduler does not implement HashBlocks (mixed Pagoda versions?)"
            raise
        if list(ours.block_hashes) != list(theirs.block_hashes):
            return (f"block hashes differ from the tokenizer's (salt {salt!r}, LoRA key "
                    f"{lora_key!r}; algorithms: tokenizer "
                    f"{tokenizer_info.prefix_caching_hash_algo or 'pagoda'!r}, scheduler "
                    f"{theirs.prefix_caching_hash_algo or 'pagoda'!r}; seeds: "
                    f"tokenizer {tokenizer_info.prefix_hash_seed!r}, scheduler "
                    f"{theirs.prefix_hash_seed!r}; block size {info.block_size}): "
                    f"KV-aware routing would never find a cached prefix. Give every "
                    f"service the same --prefix-cache-hash-seed, --prefix-caching-hash-algo "
                    f"and Pagoda version")
    return None

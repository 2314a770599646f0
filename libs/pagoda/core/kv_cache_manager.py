"""Per-request block tables on top of the block pool, with prefix caching.

Ask, then act: `get_computed_blocks` only looks; `allocate_slots` either
allocates everything a step needs or changes nothing and returns None. Nothing
is ever half-allocated.

    request blocks:  [ hit | hit | new | new ]
                      <- computed ->|<- num_new_tokens ->|
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.core.block_pool import BlockPool, KVCacheBlock
from pagoda.core.kv_events import KVEvent
from pagoda.core.request import Request


@dataclass
class PrefixCacheStats:
    """Counters since start: tokens looked up and tokens found (vLLM's queries/hits)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class KVCacheManager:
    """Invariant: `req_blocks[r]` covers at least the computed tokens of request r,
    and every block in it holds one reference for r."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 max_model_len: int) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request already registered in the cache map.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request` (whole blocks) and its token count.

        At least one token is always left to compute: the model must run on the
        last token to produce logits.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        bs = self.block_size
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            block = self.pool.get_cached_block(block_hash, request.all_token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * bs
        self.prefix_stats.requests += 1
        self.prefix_stats.queries += request.num_tokens
        self.prefix_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Returns the newly allocated blocks, or None (and changes nothing) when the
        pool cannot supply them.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_to_allocate = num_required - len(blocks) - len(new_computed_blocks)
        # Hit blocks sitting in the free queue stop being allocatable once touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_to_allocate, 0) > self.pool.num_free_blocks - num_free_hits:
            return None

        self.pool.touch(new_computed_blocks)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_to_allocate) if num_to_allocate > 0 else []
        blocks.extend(new_blocks)

        # The KV of these tokens is written this step, so their full blocks can be
        # offered to later requests now (hashes cover only known tokens).
        num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        self.pool.cache_full_blocks(blocks, request.block_hashes, request.all_token_ids,
                                    num_cached, num_full)
        self._num_cached_blocks[request.request_id] = max(num_cached, num_full)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so that the least useful KV (the
        end of a sequence) is evicted before shared prefixes."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

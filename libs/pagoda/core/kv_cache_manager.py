"""Per-request block tables on top of the block pool, with prefix caching.

Ask, then act: `get_computed_blocks` only looks; `allocate_slots` either
allocates everything a step needs or changes nothing and returns None. Nothing
is ever half-allocated.

    request blocks:  [ hit | hit | new | new ]
                      <- computed ->|<- num_new_tokens ->|

With a sliding window W (every layer windowed: `CacheConfig.sliding_window`) no query
from position c on sees a key before c - W + 1, so the blocks wholly before that
are released as the request advances and their places hold None:

    request blocks:  [ None | None | blk | blk | new ]
                       <- out of window ->|<- within W ->|

KV memory per request then stays under `(W - 1 + chunk) / block_size + 2` blocks
however long it generates. A released block keeps its hash in the pool until it is
reused, so a later request with the same prefix can still hit it; a prefix hit
always needs the whole chain of blocks from the first (`get_computed_blocks`), so a
block that was reused (its hash evicted) ends the hit there and is never served.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.core.block_pool import BlockPool, KVCacheBlock
from pagoda.core.kv_events import KVEvent
from pagoda.core.request import Request
from pagoda.core.state_checkpoints import StateCheckpoints

# The block id sent to the worker for a position whose block was released because it
# fell out of the sliding window. Attention never reads such positions.
OUT_OF_WINDOW_BLOCK_ID = 0


@dataclass
class PrefixCacheStats:
    """Counters since start: tokens looked up and tokens found (vLLM's queries/hits)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class KVCacheManager:
    """Invariant: `req_blocks[r]` covers at least the computed tokens of request r, and
    every block in it holds one reference for r; an entry is None only for a block
    wholly before the sliding window of r's next token (see the module doc)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 max_model_len: int, sliding_window: int | None = None,
                 num_state_checkpoints: int = 0) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        # A hybrid model's state checkpoints (core/state_checkpoints.py): a hit ends at
        # the last block whose state was saved. None for every other model.
        self.state_checkpoints: StateCheckpoints | None = None
        if num_state_checkpoints and enable_caching:
            self.state_checkpoints = StateCheckpoints(num_state_checkpoints)
            self.pool.on_evict = self.state_checkpoints.forget
        self.req_blocks: dict[str, list[KVCacheBlock | None]] = {}
        # Number of leading blocks of each request already registered in the cache map
        # (read by the scheduler's running loop, which inlines `allocate_slots`' first test).
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage()

    def num_blocks_out_of_window(self, num_computed_tokens: int) -> int:
        """Leading blocks that no query from position `num_computed_tokens` on can see."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

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
        request.state_restore = None
        if self.state_checkpoints is not None:  # a hybrid model: end at a saved state
            while hits:
                slot = self.state_checkpoints.lookup(request.block_hashes[len(hits) - 1])
                if slot is not None:
                    request.state_restore = slot
                    break
                hits.pop()
        num_hit_tokens = len(hits) * bs
        self.prefix_stats.requests += 1
        self.prefix_stats.queries += request.num_tokens
        self.prefix_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0,
                       delay_cache_blocks: bool = False) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones, plus
        `num_lookahead_tokens` slots after those (a draft model writes its proposals'
        KV there), first releasing the blocks that fell out of the sliding window.

        `delay_cache_blocks` (vLLM's name): the new blocks' KV arrives later (an
        asynchronous onload), so they are not offered to other requests now;
        `cache_loaded_blocks` registers them once their KV is there.

        Returns the newly allocated blocks, or None (and changes nothing) when the
        pool cannot supply them.
        """
        if not new_computed_blocks and self.sliding_window is None:
            # The common decode step: the request's blocks already cover the new
            # tokens and no block filled up, so there is nothing to allocate, release
            # or cache (the general path below would change nothing). The scheduler's
            # `_schedule_running` makes this same test inline: change both together.
            blocks = self.req_blocks.get(request.request_id)
            if blocks is not None:
                num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
                bs = self.block_size
                if (-(-(num_total + num_lookahead_tokens) // bs) <= len(blocks)
                        and min(num_total, len(request.all_token_ids)) // bs
                        <= self.num_cached_blocks.get(request.request_id, 0)):
                    return []
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens)
                         // self.block_size)
        num_to_allocate = num_required - len(blocks) - len(new_computed_blocks)
        # Out of the window: held blocks are released, hits are not taken at all.
        num_out = self.num_blocks_out_of_window(num_computed)
        released = [b for b in blocks[:num_out] if b is not None]
        num_skipped_hits = min(max(num_out - len(blocks), 0), len(new_computed_blocks))
        taken_hits = new_computed_blocks[num_skipped_hits:]
        # Hit blocks sitting in the free queue stop being allocatable once touched;
        # released blocks only this request holds become allocatable.
        num_free = (self.pool.num_free_blocks - sum(1 for b in taken_hits if b.ref_cnt == 0)
                    + sum(1 for b in released if b.ref_cnt == 1))
        if max(num_to_allocate, 0) > num_free:
            return None

        self.pool.free_blocks(released)  # oldest first: the first to be reused
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if new_computed_blocks:  # hits are cached already, taken or not
            num_cached = max(num_cached, len(blocks) + len(new_computed_blocks))
        blocks[:num_out] = [None] * min(num_out, len(blocks))
        self.pool.touch(taken_hits)
        blocks.extend([None] * num_skipped_hits)
        blocks.extend(taken_hits)
        new_blocks = self.pool.get_new_blocks(num_to_allocate) if num_to_allocate > 0 else []
        blocks.extend(new_blocks)

        # The KV of these tokens is written this step, so their full blocks can be
        # offered to later requests now (hashes cover only known tokens). Blocks
        # released for the window were full, hence cached, before their release.
        num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
        if delay_cache_blocks:
            num_full = num_cached
        self.pool.cache_full_blocks(blocks, request.block_hashes, request.all_token_ids,
                                    num_cached, num_full)
        self.num_cached_blocks[request.request_id] = max(num_cached, num_full)
        return new_blocks

    def cache_loaded_blocks(self, request: Request, num_blocks: int) -> None:
        """The first `num_blocks` blocks of `request` now hold their KV (an asynchronous
        onload finished): offer the full ones not offered yet to other requests."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks is None:
            return
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        num_full = min(num_blocks, len(blocks), request.num_tokens // self.block_size)
        self.pool.cache_full_blocks(blocks, request.block_hashes, request.all_token_ids,
                                    num_cached, num_full)
        self.num_cached_blocks[request.request_id] = max(num_cached, num_full)

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so that the least useful KV (the
        end of a sequence) is evicted before shared prefixes."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(b for b in reversed(blocks) if b is not None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [OUT_OF_WINDOW_BLOCK_ID if b is None else b.block_id
                for b in self.req_blocks.get(request_id, [])]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (those released for the window not counted)."""
        return sum(1 for b in self.req_blocks.get(request_id, []) if b is not None)

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

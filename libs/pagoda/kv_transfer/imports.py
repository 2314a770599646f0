"""The decode side's block imports: room for the blocks a remote prefill computed.

    remote prompt blocks:  [ h0 | h1 | h2 | h3 ]
    held here already:       h0              -> skipped (referenced during the pull)
    to pull:                      h1   h2  h3 -> new blocks, filled by the worker

`plan_import` references every block it returns, so nothing it names is reused
while the pull runs; `commit_import` registers the filled blocks under their hashes
(the request then finds the whole prompt as a prefix-cache hit, the one path every
request takes) or, after a failed pull, returns them unhashed; `release_import`
drops the plan's references once the request holds its own. Ask, then act: a plan
that cannot get its blocks takes none. Not thread-safe: the engine thread owns it.

With a host KV tier (--kv-offloading-size) a cached block the plan takes is evicted
without being offloaded: plans are made between steps, when the pool has no offload
sink, and must stay so. The tier's copies run with the next step, but the pull writes
into the block at once, so an offload planned here could copy pulled bytes into the
tier under the evicted block's hash (tests/kv_transfer/test_import_evictions_and_tiers.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.core.block_hash import BlockHash
from pagoda.core.block_pool import BlockPool, KVCacheBlock


@dataclass
class ImportPlan:
    """`targets[i]` receives remote block `remote_indices[i]`; `held` were cached here."""

    block_hashes: list[BlockHash]
    token_ids: list[int]
    held: list[KVCacheBlock] = field(default_factory=list)
    targets: list[KVCacheBlock] = field(default_factory=list)
    remote_indices: list[int] = field(default_factory=list)
    committed: bool = False
    released: bool = False

    @property
    def num_blocks(self) -> int:
        """Leading prompt blocks the plan covers (held + pulled)."""
        return len(self.held) + len(self.targets)


def plan_import(pool: BlockPool, block_hashes: Sequence[BlockHash],
                token_ids: Sequence[int]) -> ImportPlan:
    """Reference the blocks held here and allocate the rest, for the longest leading
    run of `block_hashes` the pool has room for (a prefix hit needs the chain whole
    from block 0, so a block after one that does not fit is of no use)."""
    bs = pool.block_size
    plan = ImportPlan(list(block_hashes), list(token_ids))
    held_at: dict[int, KVCacheBlock] = {}
    taken = 0  # allocatable blocks used: new ones, and free cached ones taken out
    covered = 0
    for i, block_hash in enumerate(block_hashes):
        block = pool.get_cached_block(block_hash, token_ids[i * bs:(i + 1) * bs])
        cost = 1 if block is None or block.ref_cnt == 0 else 0
        if taken + cost > pool.num_free_blocks:
            break
        taken += cost
        if block is not None:
            held_at[i] = block
        covered = i + 1
    plan.block_hashes = plan.block_hashes[:covered]
    plan.held = [held_at[i] for i in sorted(held_at)]
    pool.touch(plan.held)
    plan.remote_indices = [i for i in range(covered) if i not in held_at]
    plan.targets = pool.get_new_blocks(len(plan.remote_indices)) if plan.remote_indices else []
    return plan


def commit_import(pool: BlockPool, plan: ImportPlan, ok: bool) -> None:
    """After the pull: register the filled blocks (ok) or return them (not ok)."""
    if ok:
        bs = pool.block_size
        for block, i in zip(plan.targets, plan.remote_indices):
            pool.cache_block(block, plan.block_hashes, plan.token_ids[i * bs:(i + 1) * bs], i)
        plan.committed = True
    else:
        pool.free_blocks(reversed(plan.targets))
        plan.targets, plan.remote_indices = [], []


def release_import(pool: BlockPool, plan: ImportPlan) -> None:
    """Drop the plan's references (idempotent)."""
    if plan.released:
        return
    plan.released = True
    pool.free_blocks(reversed([*plan.held, *plan.targets]))

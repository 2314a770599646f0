"""Batch-invariant mode (`--batch-invariant`, VLLM_BATCH_INVARIANT=1) in bf16 on the CPU.

A token's attention output, and so a request's greedy or seeded text, must not depend
on the rest of the batch, on how its prompt was chunked, or on a prefix-cache hit.
The attention cases use SmolLM2's head shape (3 KV heads of 64, groups of 3) and
contexts past CPU SDPA's 512-key split, where the default path rounds differently.
"""

from __future__ import annotations

import random

import dataclasses

import pytest
import torch

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model.attention import paged_attention
from pagoda.model.attention_metadata import AttentionMetadata

BLOCK = 16
NUM_BLOCKS = 512
KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64


def _metadata(contexts: list[int], query_lens: list[int], tables: list[list[int]]
              ) -> AttentionMetadata:
    """Requests with `contexts[i]` cached tokens and `query_lens[i]` new ones (decodes
    must come first), block table `tables[i]`, in batch-invariant mode."""
    slots, qsl, seq_lens = [], [0], []
    for ctx, n, table in zip(contexts, query_lens, tables):
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx, ctx + n)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(ctx + n)
    width = max(map(len, tables))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=sum(1 for n in query_lens if n == 1), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        batch_invariant=True)


@pytest.fixture(params=["sdpa", "cpu-kernel"])
def kernel(request):
    """The decode kernel paged_attention gets: none (SDPA, padded as the module says) or
    the fused CPU one (every token one of its rows)."""
    if request.param == "sdpa":
        return None
    if not cpu_kernels.available():
        pytest.skip("Pagoda's CPU kernels are not built here")
    return cpu_kernels.paged_decode_attention


@pytest.fixture(scope="module")
def caches():
    torch.manual_seed(0)
    key = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    return key, torch.randn_like(key)


def _table(seq_len: int, rng: random.Random) -> list[int]:
    return rng.sample(range(NUM_BLOCKS), -(-seq_len // BLOCK))


@pytest.mark.parametrize("n", [300, 700, 1500])
def test_prompt_rows_do_not_depend_on_chunking(caches, kernel, n):
    """Every chunk [k, end) of a prompt (k cached tokens before it, one-token chunks
    included, which run as decodes) gives bit-identical rows to the whole prompt."""
    key_cache, value_cache = caches
    rng = random.Random(n)
    table = _table(n, rng)
    query = torch.randn(n, KV_HEADS * GROUP, HEAD_DIM, dtype=torch.bfloat16)
    whole = paged_attention(query, key_cache, value_cache, _metadata([0], [n], [table]), 0.125,
                            decode_kernel=kernel)
    cuts = {(1, 258), (33, 290), (n // 2, n // 2 + 34), (n - 3, n), (n - 2, n - 1), (n - 1, n),
            (rng.randrange(1, n), n)}
    for start, end in sorted(cuts):
        part = paged_attention(query[start:end], key_cache, value_cache,
                               _metadata([start], [end - start], [table]), 0.125,
                               decode_kernel=kernel)
        assert torch.equal(part, whole[start:end]), (start, end)
    # And it is attention: close to the default path's result.
    default = dataclasses.replace(_metadata([0], [n], [table]), batch_invariant=False)
    reference = paged_attention(query, key_cache, value_cache, default, 0.125)
    torch.testing.assert_close(whole.float(), reference.float(), atol=2e-2, rtol=2e-2)


def test_decode_rows_do_not_depend_on_the_batch(caches, kernel):
    """32 decodes of contexts up to 2,000 tokens, together and one by one."""
    key_cache, value_cache = caches
    rng = random.Random(1)
    contexts = [rng.randint(20, 2000) for _ in range(32)]
    # Distinct blocks per request would need more than the cache: share them, as only
    # the arithmetic is under test.
    tables = [_table(c + 1, rng) for c in contexts]
    query = torch.randn(32, KV_HEADS * GROUP, HEAD_DIM, dtype=torch.bfloat16)
    together = paged_attention(query, key_cache, value_cache,
                               _metadata(contexts, [1] * 32, tables), 0.125,
                               decode_kernel=kernel)
    for i in range(32):
        alone = paged_attention(query[i:i + 1], key_cache, value_cache,
                                _metadata([contexts[i]], [1], [tables[i]]), 0.125,
                                decode_kernel=kernel)
        assert torch.equal(alone[0], together[i]), i

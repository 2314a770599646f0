"""Inputs every attention layer needs for one step, built once by the model runner.

The kernels' own type (they import no library code); the library builds it
(`pagoda.worker.input_builder`, through `AttentionMetadata.build`) and hands it to the
torch path and the kernels alike, under its library name
`pagoda.model.attention_metadata.AttentionMetadata`.

Tokens of all scheduled requests are flattened into one batch of T tokens,
ordered request by request. Request i owns tokens
`query_start_loc[i] : query_start_loc[i+1]`; they are the positions
`seq_lens[i] - num_query_tokens_i ... seq_lens[i] - 1` of its sequence, i.e. the
request's context before this step is `seq_lens[i] - num_query_tokens_i` tokens,
already in the KV cache. A decode is simply a request with one query token.

KV cache layout per layer: key_cache, value_cache each of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`; token position p of request i
lives in block `block_tables[i, p // block_size]` at offset `p % block_size`.
`slot_mapping[t] = block * block_size + offset` for each of the T new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Invariant: requests are ordered decodes first (query length 1), then prefills
    (full or chunked), so `num_decodes` rows can be handled as one batched gather."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_req] int32 (padded with 0)
    num_decodes: int  # the first num_decodes requests have exactly one query token
    max_query_len: int
    max_seq_len: int
    # Host copies (lists) so the torch path loops without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Each token's attention independent of the rest of the batch, of chunking and of
    # prefix-cache hits, at some cost (the torch path's "Batch invariance").
    batch_invariant: bool = False
    # Hybrid models: each request's slot in the Mamba2 layers' state pools (the model
    # runner's `RecurrentStateSlots`); None for every other model.
    state_slots: list[int] | None = None
    # ... and, when some requests verify drafts, per request how many of its last tokens
    # (its drafts + 1) to keep the state after (`pagoda.model.mamba2`); 0: none.
    state_checkpoints: list[int] | None = None
    # ... and, with prefix caching (`pagoda.core.state_checkpoints`), per request None or
    # (tokens of its step after which to save the state, pool index to save it at).
    state_saves: list[tuple[int, int] | None] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def build(cls, slot_mapping: list[int], query_start_loc: list[int], seq_lens: list[int],
              block_tables: list[list[int]], num_decodes: int, device: torch.device | str,
              batch_invariant: bool = False) -> "AttentionMetadata":
        """From host lists, requests in order (decodes first): the tensors on `device`,
        each block table padded with 0 to the longest; the lists kept as host copies."""
        width = max((len(t) for t in block_tables), default=1) or 1
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        query_lens = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            num_decodes=num_decodes,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            batch_invariant=batch_invariant,
        )

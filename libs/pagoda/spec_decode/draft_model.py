"""Draft-model speculation on the worker (`--speculative-config '{"model": DRAFT,
"num_speculative_tokens": k}'`): a small model of the same tokenizer proposes k
tokens per request after each step; the target verifies them in the next one.

    step N:   target forward + sample ──► draft forward on the same tokens (its KV)
                                         └► k greedy draft decodes from the new token
              ModelRunnerOutput.draft_token_ids ──► scheduler ──► step N+1 verifies

The draft has its own weights and KV cache, indexed by the target's block tables and
slot mapping (same block ids, same block size), so it needs no block accounting of
its own: every token the target computes, the draft computes too (prefix-cache hits
included, as long as the blocks were computed here; blocks pulled from a prefill
replica carry no draft KV, which only lowers acceptance). Its proposals write draft
KV at positions after the request's known tokens: the scheduler allocates those
lookahead slots (`num_lookahead_tokens`), and a request whose blocks end earlier
proposes fewer tokens. Rejected proposals leave stale draft KV in slots the next
steps rewrite. Proposals are greedy (one-hot draft distribution), which is what the
rejection sampler assumes, so the output distribution is the target's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagoda.config import EngineConfig
from pagoda.model import batch_invariant_linear, cpu_packed_weights, prepack_cpu_weights
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.quantization.gguf_int4 import logits_head


class DraftModelRunner:
    """Invariant: `kv_caches` has as many blocks as the target's, each of `block_size`
    tokens, so a block id means the same slots in both caches."""

    def __init__(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> None:
        spec = config.scheduler.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.disable_by_batch_size = spec.disable_by_batch_size
        self.arch = load_arch_config(spec.model)
        self.arch.max_model_len = config.scheduler.max_model_len
        self.model = load_model(spec.model, self.arch, dtype, device)
        if cpu_packed_weights.applies(device, dtype):
            prepack_cpu_weights.pack_linear_weights(self.model)
        if config.batch_invariant:
            batch_invariant_linear.fix_linear_rows(self.model, logits_head(self.model))
        self.device = device
        self.block_size = config.cache.block_size
        self.batch_invariant = config.batch_invariant
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        return kv_cache_bytes_per_block(self.arch, self.block_size, kv_dtype)

    def initialize_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        self.kv_caches = allocate_kv_caches(self.arch, num_blocks, self.block_size, kv_dtype,
                                            self.device)

    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> None:
        """Compute the draft's KV for the tokens the target computed this step."""
        self.model(input_ids, positions, self.kv_caches, attn_metadata)

    def propose(self, requests: Sequence[tuple[str, list[int], list[int]]]
                ) -> dict[str, list[int]]:
        """Greedy drafts after each (req_id, token_ids, block_ids): decode from its last
        token, up to k tokens or the end of its blocks."""
        # Slots from the last token's position (the first the draft writes) to the end
        # of the request's blocks: how many draft decodes fit.
        room = {r: len(blocks) * self.block_size - (len(tokens) - 1)
                for r, tokens, blocks in requests}
        active = [(r, tokens[-1], len(tokens) - 1, blocks) for r, tokens, blocks in requests
                  if room[r] > 0]
        drafts: dict[str, list[int]] = {r: [] for r, _, _ in requests}
        for step in range(self.num_speculative_tokens):
            if not active:
                break
            ids = torch.tensor([t for _, t, _, _ in active], dtype=torch.int64,
                               device=self.device)
            positions = [p for _, _, p, _ in active]
            metadata = decode_metadata(positions, [b for _, _, _, b in active],
                                       self.block_size, self.device, self.batch_invariant)
            hidden = self.model(ids, torch.tensor(positions, dtype=torch.int64,
                                                  device=self.device), self.kv_caches, metadata)
            proposed = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            after = []
            for (req_id, _, position, blocks), token in zip(active, proposed):
                drafts[req_id].append(token)
                # The next input sits at position + 1: its slot must be in the blocks.
                if step + 1 < room[req_id]:
                    after.append((req_id, token, position + 1, blocks))
            active = after
        return drafts


def decode_metadata(positions: list[int], block_tables: list[list[int]], block_size: int,
                    device: torch.device, batch_invariant: bool = False) -> AttentionMetadata:
    """Attention metadata for one token per request at `positions`."""
    n = len(positions)
    slots = [blocks[p // block_size] * block_size + p % block_size
             for p, blocks in zip(positions, block_tables)]
    seq_lens = [p + 1 for p in positions]
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    query_start = list(range(n + 1))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), num_decodes=n, max_query_len=1,
        max_seq_len=max(seq_lens), query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens,
        batch_invariant=batch_invariant)

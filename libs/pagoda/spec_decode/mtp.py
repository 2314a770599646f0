"""MTP speculation on the worker (`--speculative-config '{"method": "mtp"}'`, vLLM's
`deepseek_mtp`): the target checkpoint's multi-token-prediction layer
(`pagoda.model.deepseek_mtp`) proposes k tokens per request after each step; the
target verifies them in the next one, through the same rejection path as any draft.

    step N:  target forward (pre-norm hidden h) + sample
             ──► MTP pass over the step's rows: row t takes (token t+1, h_t), at position t
                 └► its last valid row's logits: draft 1
             ──► k-1 decodes of the MTP layer: (draft j, its own previous hidden), at the
                 next position: drafts 2..k
             ModelRunnerOutput.draft_token_ids ──► scheduler ──► step N+1 verifies

As vLLM (EagleProposer with method "mtp"): the first MTP layer serves every draft
position (later ones are not run), the later drafts take the MTP layer's own output
as their previous hidden state, and drafts are greedy (one-hot), which is what the
rejection sampler assumes, so the output distribution is the target's.

The token after a row: the next row's input, except at a request's last valid row,
where it is the token the step sampled (or, mid-prompt, the next prompt token). A
request that verified drafts has rows past its last accepted one: they are computed
(vLLM's "padded" drafter batch) but their MTP cache entries are stale and rewritten
when the target computes those positions again; no valid row attends to them (causal).

The MTP layer's cache is one more layer of latents, indexed by the target's block ids
and slot mapping (same block ids, same block size), so it needs no block accounting of
its own; the MTP pass uses the target step's attention metadata as it is (same
positions). The k-1 decodes write at positions after the request's known tokens: the
scheduler's lookahead slots (`num_lookahead_tokens`); a request whose blocks end earlier
proposes fewer tokens. Blocks this replica did not compute itself (pulled from a peer,
onloaded from the host tier) carry no MTP entries: that only lowers acceptance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from pagoda.config import EngineConfig
from pagoda.model.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
from pagoda.spec_decode.draft_model import decode_metadata
from pagoda.worker.batch_state import CachedRequestState
from pagoda.worker.input_builder import ModelInputs


class MTPProposer:
    """Invariant: after `propose`, the cache entry at every position t a request's
    target computed (up to its last accepted token) holds the MTP layer's latent for
    (h_t, the token at t + 1), for every request in the step."""

    def __init__(self, model, config: EngineConfig, device: torch.device) -> None:
        spec = config.scheduler.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.disable_by_batch_size = spec.disable_by_batch_size
        self.layer = model.mtp_layer
        self.stack = model.model  # its rotary embedding and the pre-norm hidden state
        # The cache of one layer of the target's kind (latents).
        self.cache_arch = dataclasses.replace(config.arch, num_hidden_layers=1, mamba=None)
        self.block_size = config.cache.block_size
        self.max_model_len = config.scheduler.max_model_len
        self.batch_invariant = config.batch_invariant
        self.device = device
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        return kv_cache_bytes_per_block(self.cache_arch, self.block_size, kv_dtype)

    def initialize_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        self.kv_cache = allocate_kv_caches(self.cache_arch, num_blocks, self.block_size,
                                           kv_dtype, self.device)[0]

    def propose(self, inputs: ModelInputs, sampled: Sequence[list[int]],
                states: Mapping[str, CachedRequestState], wanted: set[str]
                ) -> dict[str, list[int]]:
        """The MTP pass over the step's rows (always: it fills the MTP cache), then up to
        k greedy drafts for each request in `wanted` that sampled this step."""
        hidden = self.stack.pre_norm_hidden
        positions = inputs.positions
        qsl = inputs.attn_metadata.query_start_loc_cpu
        next_ids = inputs.input_ids.tolist()[1:] + [0]
        last_rows: dict[str, int] = {}
        for i, req_id in enumerate(inputs.req_ids):
            start, end = qsl[i], qsl[i + 1]
            state, tokens = states[req_id], sampled[i]
            if tokens:  # rows up to the last accepted draft are valid
                valid = end - start - len(state.spec_token_ids) + len(tokens) - 1
                next_ids[start + valid - 1] = tokens[-1]
                if req_id in wanted:
                    last_rows[req_id] = start + valid - 1
            elif state.num_computed_tokens < len(state.token_ids):  # mid-prompt
                next_ids[end - 1] = state.token_ids[state.num_computed_tokens]
        ids = torch.tensor(next_ids, dtype=torch.int64, device=self.device)
        cos, sin = self.stack.rotary_emb(positions, hidden.dtype)
        out = self.layer.predict(ids, positions, hidden, cos, sin, self.kv_cache,
                                 inputs.attn_metadata)
        if not last_rows:
            return {}
        rows = list(last_rows.values())
        first = self.layer.compute_logits(out[rows]).argmax(dim=-1).tolist()
        drafts = {r: [t] for r, t in zip(last_rows, first)}
        # (req_id, its last draft, its position, its blocks, previous hidden row)
        active = [(r, t, int(positions[row]) + 1, states[r].block_ids, out[row])
                  for (r, row), t in zip(last_rows.items(), first)]
        for _ in range(self.num_speculative_tokens - 1):
            # The decode writes the MTP cache at `position`: its slot must be in the blocks.
            active = [a for a in active
                      if a[2] < min(len(a[3]) * self.block_size, self.max_model_len)]
            if not active:
                break
            pos = [a[2] for a in active]
            metadata = decode_metadata(pos, [a[3] for a in active], self.block_size,
                                       self.device, self.batch_invariant)
            pos_t = torch.tensor(pos, dtype=torch.int64, device=self.device)
            ids = torch.tensor([a[1] for a in active], dtype=torch.int64, device=self.device)
            cos, sin = self.stack.rotary_emb(pos_t, hidden.dtype)
            step = self.layer.predict(ids, pos_t, torch.stack([a[4] for a in active]), cos, sin,
                                      self.kv_cache, metadata)
            proposed = self.layer.compute_logits(step).argmax(dim=-1).tolist()
            for (req_id, *_), token in zip(active, proposed):
                drafts[req_id].append(token)
            active = [(r, token, p + 1, blocks, step[j])
                      for j, ((r, _, p, blocks, _), token) in enumerate(zip(active, proposed))]
        return drafts

"""Flattens one step's scheduled requests into model inputs and attention metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.worker.batch_state import CachedRequestState


@dataclass
class ModelInputs:
    """Row order: decodes first, then prefills (the order AttentionMetadata wants)."""

    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Index into the flattened tokens of each request's last scheduled token.
    last_token_indices: list[int]
    # The request reaches the end of its known tokens this step, so it samples (a
    # pooling request never samples: the model runner pools it instead).
    samples: list[bool]
    # Draft tokens verified after the known ones (speculative decoding), per request.
    num_drafts: list[int] | None = None

    def sample_rows(self) -> list[int]:
        """The rows of the step's hidden states that give logits: per sampling request
        its last token, preceded by one row per draft token (the distribution after
        each accepted prefix of its drafts)."""
        drafts = self.num_drafts or [0] * len(self.req_ids)
        return [r for i, s in enumerate(self.samples) if s
                for r in range(self.last_token_indices[i] - drafts[i],
                               self.last_token_indices[i] + 1)]


def order_decodes_first(num_scheduled: dict[str, int]) -> list[str]:
    decodes = [r for r, n in num_scheduled.items() if n == 1]
    prefills = [r for r, n in num_scheduled.items() if n != 1]
    return decodes + prefills


def build_model_inputs(states: dict[str, CachedRequestState], num_scheduled: dict[str, int],
                       block_size: int, device: torch.device | str,
                       batch_invariant: bool = False) -> ModelInputs:
    req_ids = order_decodes_first(num_scheduled)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    samples: list[bool] = []
    tables: list[list[int]] = []
    num_decodes = 0
    for req_id in req_ids:
        state = states[req_id]
        n = num_scheduled[req_id]
        start = state.num_computed_tokens
        end = start + n
        if n == 1:
            num_decodes += 1
        if state.spec_token_ids:  # the known tokens, then the drafts to verify
            input_ids.extend((state.token_ids + state.spec_token_ids)[start:end])
        else:
            input_ids.extend(state.token_ids[start:end])
        positions.extend(range(start, end))
        blocks = state.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start.append(query_start[-1] + n)
        seq_lens.append(end)
        samples.append(end >= len(state.token_ids) and state.pooling_params is None)
        tables.append(blocks)
    metadata = AttentionMetadata.build(slots, query_start, seq_lens, tables, num_decodes, device,
                                       batch_invariant)
    num_drafts = [len(states[r].spec_token_ids) for r in req_ids]
    return ModelInputs(req_ids, torch.tensor(input_ids, dtype=torch.int64, device=device),
                       torch.tensor(positions, dtype=torch.int64, device=device), metadata,
                       [q - 1 for q in query_start[1:]], samples,
                       num_drafts if any(num_drafts) else None)

"""A step's input embeddings for a multi-modal model: the text embeddings of the step's
tokens with each media item's encoder rows scattered over its placeholder positions.

    request tokens   ... t  <im> <im> <im> <im> <im>  t ...
    this step              [─────── chunk ───────]
    encoder rows          r0   r1   r2   r3   r4          (item encoded once, cached)
    scattered              ·   r1   r2   r3   ·           (the chunk's part of the run)

A chunk may end or start inside a run (chunked prefill, a prefix hit ending mid-run):
the rows come from the encoder cache, which keeps the item while its run is not fully
computed (`EncoderCache`), or the item is encoded again from its data. Either way the
rows are the same, so the split never changes the answer.
"""

from __future__ import annotations

import torch

from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.worker.batch_state import CachedRequestState
from pagoda.worker.encoder_cache import EncoderCache
from pagoda.worker.input_builder import ModelInputs


class MultiModalStepInputs:
    """Builds `inputs_embeds` for the steps of one multi-modal model.

    Invariant: `prepare` returns None when no scheduled token of the step is a
    placeholder (the model then embeds `input_ids` itself), else [T, hidden] rows in
    the step's token order.
    """

    def __init__(self, model, cache: EncoderCache) -> None:
        self.model = model
        self.cache = cache

    def prepare(self, states: dict[str, CachedRequestState], inputs: ModelInputs
                ) -> torch.Tensor | None:
        qsl = inputs.attn_metadata.query_start_loc_cpu
        spans: list[tuple[MultiModalFeature, int, int, int]] = []  # feature, row, p0, p1
        for i, req_id in enumerate(inputs.req_ids):
            state = states[req_id]
            if not state.mm_features:
                continue
            start = state.num_computed_tokens
            end = start + (qsl[i + 1] - qsl[i])
            for feature in state.mm_features:
                if feature.overlaps(start, end):
                    spans.append((feature, qsl[i], start, end))
                    self._count_lookup(state, feature)
        if not spans:
            return None
        rows = self._encoder_rows([f for f, *_ in spans])
        embeds = self.model.embed_input_ids(inputs.input_ids)
        for feature, row0, start, end in spans:
            p0, p1 = max(start, feature.offset), min(end, feature.end)
            targets, sources = _scatter_indices(feature, p0, p1)
            embeds[row0 + (targets - start)] = rows[feature.identifier][sources].to(embeds.dtype)
        return embeds

    @property
    def uses_mrope(self) -> bool:
        return getattr(self.model, "uses_mrope", False)

    def positions(self, states: dict[str, CachedRequestState], inputs: ModelInputs
                  ) -> torch.Tensor:
        """M-RoPE positions [3, T] of the step's tokens: a prompt token's from the model's
        table, a generated token's its sequence position + delta on all three axes."""
        qsl = inputs.attn_metadata.query_start_loc_cpu
        rows = []
        for i, req_id in enumerate(inputs.req_ids):
            state = states[req_id]
            if state.mrope is None:
                state.mrope = self.model.mrope_positions(state.prompt_token_ids,
                                                         state.mm_features)
            table, delta = state.mrope
            start, end = state.num_computed_tokens, state.num_computed_tokens + (qsl[i + 1] - qsl[i])
            prompt_end = min(end, table.shape[1])
            part = [table[:, start:prompt_end]] if start < prompt_end else []
            if end > table.shape[1]:
                generated = torch.arange(max(start, table.shape[1]), end) + delta
                part.append(generated.expand(3, -1))
            rows.extend(part)
        return torch.cat(rows, dim=1).to(inputs.positions.device)

    def _count_lookup(self, state: CachedRequestState, feature: MultiModalFeature) -> None:
        """One counted lookup per request and item: where the request first needs it."""
        seen = state.mm_looked_up
        if feature.identifier not in seen:
            seen.add(feature.identifier)
            self.cache.lookup(feature.identifier)

    def _encoder_rows(self, features: list[MultiModalFeature]) -> dict[str, torch.Tensor]:
        """identifier -> encoder rows of each item, encoding (once) the ones not cached."""
        rows: dict[str, torch.Tensor] = {}
        missing: dict[str, MultiModalFeature] = {}
        for feature in features:
            cached = self.cache.get(feature.identifier)
            if cached is not None:
                rows[feature.identifier] = cached
            elif feature.identifier not in missing:
                if feature.data is None:
                    raise ValueError(f"{feature.modality} {feature.identifier[:12]} has no "
                                     "encoder input here and is not in the encoder cache")
                missing[feature.identifier] = feature
        if missing:
            outputs = self.model.embed_multimodal([f.data for f in missing.values()])
            for (identifier, feature), out in zip(missing.items(), outputs):
                if out.shape[0] != feature.num_embeds:
                    raise ValueError(f"the encoder gave {out.shape[0]} rows for a "
                                     f"{feature.modality} whose run takes {feature.num_embeds}")
                self.cache.put(identifier, out)
                rows[identifier] = out
        return rows

    def release(self, states: dict[str, CachedRequestState]) -> None:
        """After the step: items whose runs are fully computed may leave the cache."""
        needed = [f.identifier for s in states.values() for f in s.mm_features
                  if f.end > s.num_computed_tokens]
        self.cache.evict(needed)


def _scatter_indices(feature: MultiModalFeature, p0: int, p1: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt positions in [p0, p1) that take an encoder row, those rows' indices)."""
    positions = torch.arange(p0, p1)
    if feature.is_embed is None:
        return positions, positions - feature.offset
    mask = feature.is_embed.to(torch.bool)
    rank = torch.cumsum(mask.to(torch.int64), 0) - 1  # encoder row of each masked position
    local = positions - feature.offset
    keep = mask[local]
    return positions[keep], rank[local[keep]]

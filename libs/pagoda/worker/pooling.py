"""The worker's side of pooling requests: which rows of a step they own, their token
types, and their pooled vectors (`ModelRunnerOutput.pooler_output`).

A pooling request runs its whole remaining prompt in one step (the scheduler never
chunks it), so the step that runs it is the step that pools it; its prompt's rows
are `query_start_loc[i]:query_start_loc[i + 1]` of the step's hidden states.
"""

from __future__ import annotations

import torch

from pagoda.model.pooler import Pooler
from pagoda.worker.batch_state import CachedRequestState
from pagoda.worker.input_builder import ModelInputs


def pool_requests(pooler: Pooler | None, states: dict[str, CachedRequestState],
                  inputs: ModelInputs, hidden: torch.Tensor) -> dict[str, list[float]]:
    """req_id -> pooled vector for each pooling request whose prompt ends this step."""
    md = inputs.attn_metadata
    qsl, seq_lens = md.query_start_loc_cpu, md.seq_lens_cpu
    rows = [i for i, req_id in enumerate(inputs.req_ids)
            if states[req_id].pooling_params is not None
            and seq_lens[i] >= len(states[req_id].token_ids)]
    if not rows:
        return {}
    if pooler is None:
        raise ValueError("a pooling request reached a model runner without a pooler "
                         "(the engine runs --runner generate)")
    chosen = [states[inputs.req_ids[i]] for i in rows]
    spans = [(qsl[i], qsl[i + 1], qsl[i + 1] - qsl[i] == seq_lens[i]) for i in rows]
    vectors = pooler(hidden, spans, [s.pooling_params for s in chosen])
    return {s.req_id: v.tolist() for s, v in zip(chosen, vectors)}


def token_type_ids(states: dict[str, CachedRequestState], inputs: ModelInputs
                   ) -> torch.Tensor | None:
    """The step's token types [T] (1 from each pair's `token_type_split` on), or None
    when no request of the step is a text pair. Positions count from the prompt's
    start, which is the step's first row of the request (its prompt runs whole)."""
    splits = {i: states[r].pooling_params.token_type_split for i, r in enumerate(inputs.req_ids)
              if states[r].pooling_params is not None
              and states[r].pooling_params.token_type_split is not None}
    if not splits:
        return None
    qsl = inputs.attn_metadata.query_start_loc_cpu
    types = torch.zeros(len(inputs.input_ids), dtype=torch.int64)
    for i, split in splits.items():
        types[qsl[i] + split:qsl[i + 1]] = 1
    return types.to(inputs.input_ids.device)

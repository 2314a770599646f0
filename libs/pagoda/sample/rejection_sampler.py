"""Verify draft tokens against the target model, keeping the target's distribution.

A request with k drafts d_1..d_k contributes k + 1 rows of logits: row j is the
target's next-token distribution after the request's tokens and d_1..d_j (row 0:
after its own tokens only). Each row is processed exactly as the plain sampler would
process it had d_1..d_j been sampled (penalties, min_tokens, bad words, logit bias and
allowed ids see them as output tokens: the caller builds the row's metadata so).

Walking j = 0, 1, ...:
  * greedy row: the target token t_j = argmax; d_{j+1} is accepted iff it equals t_j.
    The emitted tokens are therefore exactly what greedy decoding without drafts emits.
  * random row: the draft distribution of an n-gram proposer is a point mass, so
    Leviathan et al.'s rule accepts d_{j+1} with probability min(1, p_j(d) / 1) =
    p_j(d); on rejection it samples from the residual max(0, p_j - q) (p_j without d,
    renormalised). Emitted tokens are distributed exactly as sampling from p_j would.
The walk stops at the first rejection, emitting the target's token in its place;
when every draft is accepted, the last row adds one more (the "bonus") token. So a
request emits between 1 and k + 1 tokens per step.

Random rows use torch's default generator: a seeded request is never given drafts
(its one-draw-per-token generator invariant, `pagoda.sample.sampler`, would break).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.sample.logprobs import LogprobsTensors, compute_topk_logprobs
from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.sampler import Sampler, exponential_noise, needs_processing, random_probs
from pagoda.sampling_params import GREEDY_TEMPERATURE_EPS


@dataclass
class VerifiedTokens:
    """Per request (in the order of `drafts`): the tokens it emits this step, and the
    logits row each of them came from (for logprobs)."""

    token_ids: list[list[int]]
    rows: list[list[int]]
    logprobs: LogprobsTensors | None  # one row per emitted token, in emission order


def verify_drafts(logits: torch.Tensor, metadata: SamplingMetadata,
                  drafts: list[list[int]]) -> VerifiedTokens:
    """`logits` [sum(len(d) + 1), V]: request i's rows are consecutive, row j of them
    the distribution after its j-th draft; `metadata` is row-aligned with `logits`."""
    raw = logits.float()
    processed = Sampler.process_logits(raw, metadata) if needs_processing(metadata) else raw
    greedy_rows = (metadata.temperature < GREEDY_TEMPERATURE_EPS).tolist() if not metadata.all_greedy \
        else [True] * raw.shape[0]
    target = processed.argmax(dim=-1)
    draft_col = torch.tensor([d for ds in drafts for d in (*ds, 0)], dtype=torch.long,
                             device=raw.device)
    accept_prob = residual_sample = None
    random_rows = [r for r, g in enumerate(greedy_rows) if not g]
    if random_rows:
        index = torch.tensor(random_rows, dtype=torch.long, device=raw.device)
        probs = random_probs(processed[index], metadata, random_rows)
        full = probs.div(exponential_noise(probs, {})).argmax(dim=-1)
        # Rejection samples from p without the draft token (the residual): the draft
        # column zeroed; the race needs no normalisation.
        cols = draft_col[index].unsqueeze(1)
        accept_prob = torch.zeros(raw.shape[0], device=raw.device)
        accept_prob[index] = probs.gather(1, cols).squeeze(1)
        residual = probs.scatter(1, cols, 0.0)
        target[index] = full
        residual_sample = target.clone()
        residual_sample[index] = residual.div_(exponential_noise(residual, {})).argmax(dim=-1)
        accept_prob = (torch.rand(raw.shape[0], device=raw.device) < accept_prob).tolist()
        residual_sample = residual_sample.tolist()
    targets = target.tolist()

    token_ids: list[list[int]] = []
    rows: list[list[int]] = []
    row = 0
    for ds in drafts:
        emitted, used = [], []
        for j, draft in enumerate((*ds, None)):
            r = row + j
            used.append(r)
            if draft is None:  # every draft accepted: the bonus token
                emitted.append(targets[r])
            elif greedy_rows[r]:
                emitted.append(targets[r])
                if targets[r] != draft:
                    break
            elif accept_prob[r]:
                emitted.append(draft)
                continue
            else:
                emitted.append(residual_sample[r])
                break
        token_ids.append(emitted)
        rows.append(used)
        row += len(ds) + 1
    logprobs = None
    if metadata.max_num_logprobs is not None:
        flat = [r for used in rows for r in used]
        chosen = torch.tensor([t for ts in token_ids for t in ts], dtype=torch.long,
                              device=raw.device)
        logprobs = compute_topk_logprobs(raw[flat], chosen, metadata.max_num_logprobs)
    return VerifiedTokens(token_ids, rows, logprobs)

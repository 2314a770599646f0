"""Temperature and the truncation rules top-k, top-p and min-p.

Applied in that order (HF's order), each to the distribution the previous one left:
softmax(logits / T), cut to the top-k, then to the nucleus of mass top_p, then to
the tokens at least min_p times as likely as the most likely one. A removed token
gets logit -inf. Every function works row by row, so a row's result does not depend
on the other rows of the batch; the three truncations modify `logits` in place and
return it.

(vLLM v1 applies min-p before top-k/top-p; vLLM v0 and HF use the order here. The
two differ only when a row sets both top_p and min_p: min-p is a ratio to the top
token, which top-k and top-p never remove, so its cut does not depend on its place.)
"""

from __future__ import annotations

import torch

from pagoda.sampling_params import GREEDY_TEMPERATURE_EPS

# Top-p first looks for the nucleus among a row's most likely tokens: a topk of 128
# is over 30x cheaper than sorting a 49152-token vocabulary on a CPU, and real
# next-token distributions usually put their top_p mass in that many tokens. Rows
# whose nucleus is wider move on to the next tier; the last tier is the full
# vocabulary, so the result is exact in every case.
TOP_P_CANDIDATE_TIERS = (128, 2048)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / T row-wise (a new tensor); greedy rows (T ~ 0) are divided by 1."""
    safe = torch.where(temperature < GREEDY_TEMPERATURE_EPS, 1.0, temperature)
    return logits / safe.to(logits.dtype).unsqueeze(1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the top_k[i] largest logits of row i (ties with the k-th value kept too).

    top_k[i] >= V disables it for that row.
    """
    vocab_size = logits.shape[1]
    disabled = top_k >= vocab_size
    k = top_k.masked_fill(disabled, 1).to(logits.device)
    max_k = int(k.max())
    kth_value = logits.topk(max_k, dim=1).values.gather(1, (k - 1).unsqueeze(1))
    kth_value.masked_fill_(disabled.unsqueeze(1).to(logits.device), -float("inf"))
    return logits.masked_fill_(logits < kth_value, -float("inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p[i].

    With the row's probabilities sorted descending, token j is kept iff the mass of
    the tokens before it is < top_p (so the most likely token always stays).
    top_p[i] == 1 disables it for that row.
    """
    num_rows, vocab_size = logits.shape
    top_p = top_p.to(logits.device)
    probs = torch.softmax(logits, dim=-1)
    pending = top_p < 1.0
    remove = torch.zeros_like(logits, dtype=torch.bool)
    # What the last tier saw of a row: the mass of its `seen` top tokens and the
    # smallest of them. Any m >= seen top tokens hold at most
    # mass + (m - seen) * floor, so a tier that cannot reach top_p is skipped.
    mass = torch.zeros(num_rows, device=logits.device)
    floor = torch.ones(num_rows, device=logits.device)
    seen = torch.zeros(num_rows, device=logits.device)
    for tier in (*TOP_P_CANDIDATE_TIERS, vocab_size):
        num_candidates = min(tier, vocab_size)
        attempt = pending
        if num_candidates < vocab_size:
            attempt = pending & (mass + (num_candidates - seen) * floor >= top_p)
        rows = torch.nonzero(attempt).squeeze(1)
        if rows.numel() == 0:
            continue
        all_rows = rows.numel() == num_rows  # the common case: no row copies
        covered, covered_remove, rows_mass, rows_floor = _nucleus_among_top(
            probs if all_rows else probs[rows], top_p if all_rows else top_p[rows],
            num_candidates)
        done = rows[covered]
        if done.numel() == num_rows:
            remove = covered_remove
        else:
            remove[done] = covered_remove
        pending[done] = False
        mass[rows], floor[rows], seen[rows] = rows_mass, rows_floor, float(num_candidates)
    return logits.masked_fill_(remove, -float("inf"))


def _nucleus_among_top(probs: torch.Tensor, top_p: torch.Tensor, num_candidates: int):
    """Look for each row's nucleus among its `num_candidates` most likely tokens.

    Returns (covered [R] bool: the nucleus lies within the candidates, i.e. they hold
    >= top_p of the mass; the [covered, V] mask of tokens to remove for those rows;
    the candidates' mass [R]; the smallest candidate prob [R]).
    """
    vocab_size = probs.shape[1]
    sorted_probs, sorted_ids = probs.topk(num_candidates, dim=1)
    mass_through = sorted_probs.cumsum(dim=1)
    keep_sorted = (mass_through - sorted_probs) < top_p.unsqueeze(1)
    covered = (mass_through[:, -1] >= top_p) | (num_candidates == vocab_size)
    remove = torch.ones((int(covered.sum()), vocab_size), dtype=torch.bool, device=probs.device)
    remove.scatter_(1, sorted_ids[covered], ~keep_sorted[covered])
    return covered, remove, mass_through[:, -1], sorted_probs[:, -1]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p[i] * (the row's largest prob).

    Computed on logits: p_j < min_p * p_max  <=>  logit_j < logit_max + ln(min_p),
    which needs no softmax. min_p[i] == 0 disables it (ln 0 = -inf removes nothing).
    """
    threshold = logits.amax(dim=1, keepdim=True) + torch.log(min_p.to(logits.device)).unsqueeze(1)
    return logits.masked_fill_(logits < threshold, -float("inf"))

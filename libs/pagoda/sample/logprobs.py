"""Log-probabilities of chosen tokens plus the top-k alternatives, as tensors.

Used for both sampled tokens (the sampler) and prompt tokens (the model runner):
row j of the logits scores `token_ids[j]`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagoda.messages import LogprobsLists


class LogprobsTensors(NamedTuple):
    """Per-row logprobs, `k + 1` columns.

    Column 0 is the chosen token (the sampled or the next prompt token) and columns
    1..k the k most likely tokens, best first. `ranks` are 1-based ranks in the full
    vocabulary: the chosen token's rank is the number of tokens at least as likely as
    it (vLLM's rule, so a tie ranks after its equals); the top-k columns rank 1..k.
    All three tensors have shape [N, k + 1] and live on the logits' device.
    """

    token_ids: torch.Tensor  # int64
    logprobs: torch.Tensor  # float32
    ranks: torch.Tensor  # int64

    def tolists(self) -> LogprobsLists:
        """One host transfer per tensor; the runner slices rows out of the lists."""
        return LogprobsLists(
            token_ids=self.token_ids.tolist(),
            logprobs=self.logprobs.tolist(),
            ranks=self.ranks.tolist(),
        )


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary log-probabilities in float32 (a new tensor)."""
    return torch.log_softmax(logits.float(), dim=-1)


def compute_topk_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Score `token_ids[j]` under row j of `logits` [N, V] and list that row's top-k.

    `logits` is not modified. `k` may be 0 (only the chosen token) and at most V.
    """
    return gather_topk_logprobs(compute_logprobs(logits), token_ids, k)


def gather_topk_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                         k: int) -> LogprobsTensors:
    """Like `compute_topk_logprobs`, from already normalised log-probabilities."""
    num_rows, vocab_size = logprobs.shape
    if not 0 <= k <= vocab_size:
        raise ValueError(f"k must be in [0, {vocab_size}], got {k}.")
    chosen_ids = token_ids.to(device=logprobs.device, dtype=torch.long).view(num_rows, 1)
    chosen_logprobs = logprobs.gather(1, chosen_ids)
    # Summing the comparison as uint8 into int32 avoids widening [N, V] to int64
    # first, which cost more than the comparison itself.
    at_least_as_likely = (logprobs >= chosen_logprobs).view(torch.uint8)
    chosen_ranks = at_least_as_likely.sum(dim=1, keepdim=True, dtype=torch.int32).long()
    topk_logprobs, topk_ids = torch.topk(logprobs, k, dim=1)
    topk_ranks = torch.arange(1, k + 1, device=logprobs.device).expand(num_rows, k)
    return LogprobsTensors(
        token_ids=torch.cat((chosen_ids, topk_ids), dim=1),
        logprobs=torch.cat((chosen_logprobs, topk_logprobs), dim=1),
        ranks=torch.cat((chosen_ranks, topk_ranks), dim=1),
    )

"""Top-k, top-p, min-p and temperature: the masks directly, then the sampled support."""

from __future__ import annotations

import pytest
import torch

from pagoda.sample import truncation
from pagoda.sample.sampler import Sampler
from pagoda.sample.truncation import apply_min_p, apply_temperature, apply_top_k, apply_top_p
from pagoda.sampling_params import SamplingParams as SP

PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]
NUM_DRAWS = 20_000


def _logits(probs, rows=1):
    return torch.tensor(probs).log().repeat(rows, 1)


def _kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row)).squeeze(1).tolist() for row in logits]


# ----------------------------------------------------------------------------- masks
def test_top_k_mask_keeps_k_largest_and_ties():
    logits = torch.tensor([[1.0, 5.0, 3.0, 3.0, 0.0], [1.0, 5.0, 3.0, 3.0, 0.0],
                           [1.0, 5.0, 3.0, 2.0, 0.0]])
    out = apply_top_k(logits.clone(), torch.tensor([1, 2, 5]))  # 5 = V: disabled
    assert _kept(out) == [[1], [1, 2, 3], [0, 1, 2, 3, 4]]  # the tie with the 2nd stays
    assert torch.equal(out[2], logits[2])


@pytest.mark.parametrize("top_p, kept", [(0.45, [0]), (0.6, [0, 1]), (0.75, [0, 1, 2]),
                                         (0.9, [0, 1, 2, 3]), (0.97, [0, 1, 2, 3, 4]),
                                         (1.0, [0, 1, 2, 3, 4])])
def test_top_p_mask_keeps_smallest_prefix_reaching_top_p(top_p, kept):
    # Shuffled so the rule cannot lean on the token order.
    order = [3, 0, 4, 2, 1]
    logits = _logits([PROBS[i] for i in order])
    out = apply_top_p(logits, torch.tensor([top_p]))
    assert sorted(_kept(out)[0]) == sorted(order.index(i) for i in kept)


def test_top_p_boundary_mass_equal_to_top_p_is_not_kept():
    # Uniform over 4: exact masses 0, .25, .5, .75 before each token; top_p=.5 keeps 2.
    out = apply_top_p(torch.zeros(1, 4), torch.tensor([0.5]))
    assert torch.isfinite(out).sum().item() == 2


def _top_p_reference(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Float64 full sort: keep token j iff the mass strictly before it is < top_p."""
    probs = torch.softmax(logits.double(), dim=-1)
    sorted_probs, ids = probs.sort(descending=True)
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, ids, keep_sorted)


def test_top_p_candidate_tiers_match_a_full_sort():
    torch.manual_seed(0)
    vocab_size = 5000
    scales = [0.05, 0.5, 2.0, 8.0]  # flat .. peaky: nuclei from thousands of tokens to one
    top_ps = [0.1, 0.5, 0.9, 0.99]
    logits = torch.cat([torch.randn(2, vocab_size) * s for s in scales for _ in top_ps])
    row_top_p = torch.tensor([p for _ in scales for p in top_ps for _ in range(2)])
    # Plus one disabled row (top_p = 1), which must come back untouched.
    disabled = torch.randn(1, vocab_size)
    out = apply_top_p(torch.cat((logits, disabled)), torch.cat((row_top_p, torch.ones(1))))
    assert torch.equal(out[-1:], disabled)
    out = out[:-1]
    kept = torch.isfinite(out)
    expected = torch.stack([_top_p_reference(logits[i], row_top_p[i].item())
                            for i in range(len(logits))])
    assert torch.equal(kept, expected)
    sizes = kept.sum(1)
    tier1, tier2 = truncation.TOP_P_CANDIDATE_TIERS
    # Every tier (candidates, more candidates, full vocabulary) was exercised.
    assert (sizes <= tier1).any() and ((sizes > tier1) & (sizes <= tier2)).any()
    assert (sizes > tier2).any()


def test_min_p_mask_keeps_tokens_at_least_min_p_times_the_top():
    out = apply_min_p(_logits(PROBS, rows=4), torch.tensor([0.25, 0.5, 0.0, 1.0]))
    assert _kept(out) == [[0, 1, 2], [0], [0, 1, 2, 3, 4], [0]]


def test_temperature_divides_random_rows_only():
    logits = torch.tensor([[2.0, -4.0], [2.0, -4.0], [2.0, -4.0]])
    out = apply_temperature(logits, torch.tensor([0.5, 2.0, 0.0]))
    assert torch.equal(out, torch.tensor([[4.0, -8.0], [1.0, -2.0], [2.0, -4.0]]))


# ----------------------------------------------------------------------------- sampling
def _sample_frequencies(build, params: SP, probs) -> torch.Tensor:
    torch.manual_seed(1234)
    md = build([params] * NUM_DRAWS, len(probs))
    tokens = Sampler()(_logits(probs, NUM_DRAWS), md).sampled_token_ids
    return torch.bincount(tokens, minlength=len(probs)).double() / NUM_DRAWS


def _renormalised(probs, kept):
    total = sum(probs[i] for i in kept)
    return torch.tensor([probs[i] / total if i in kept else 0.0 for i in range(len(probs))],
                        dtype=torch.float64)


@pytest.mark.parametrize("params, kept", [
    (SP(), [0, 1, 2, 3, 4]),
    (SP(top_k=3), [0, 1, 2]),
    (SP(top_p=0.6), [0, 1]),
    (SP(min_p=0.25), [0, 1, 2]),
    (SP(top_k=4, top_p=0.75, min_p=0.25), [0, 1, 2]),
])
def test_sampled_support_and_frequencies(build, params, kept):
    freq = _sample_frequencies(build, params, PROBS)
    assert torch.nonzero(freq).squeeze(1).tolist() == kept
    # Within ~5 standard deviations of the renormalised distribution.
    assert torch.allclose(freq, _renormalised(PROBS, kept), atol=0.018)


def test_top_p_applies_to_the_top_k_renormalised_distribution(build):
    probs = [0.4, 0.3, 0.2, 0.1]
    # Alone, top_p=0.55 keeps {0, 1}; after top_k=2 token 0 holds 0.57 >= 0.55.
    def support(params: SP) -> list[int]:
        return torch.nonzero(_sample_frequencies(build, params, probs)).flatten().tolist()

    assert support(SP(top_p=0.55)) == [0, 1]
    assert support(SP(top_k=2, top_p=0.55)) == [0]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_the_sampled_distribution(build, temperature):
    probs = [0.5, 0.3, 0.2]
    freq = _sample_frequencies(build, SP(temperature=temperature), probs)
    powered = [p ** (1.0 / temperature) for p in probs]
    expected = torch.tensor([p / sum(powered) for p in powered], dtype=torch.float64)
    assert torch.allclose(freq, expected, atol=0.018)
    assert not torch.allclose(expected, torch.tensor(probs, dtype=torch.float64), atol=0.05)


def test_extreme_low_temperature_is_effectively_argmax(build):
    torch.manual_seed(0)
    logits = torch.randn(64, 1000)
    md = build([SP(temperature=1e-4)] * 64, 1000)
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))

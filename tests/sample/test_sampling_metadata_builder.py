"""build_sampling_metadata: row layout, fast-path Nones, min_tokens, bias, logprobs."""

from __future__ import annotations

import pytest
import torch

from pagoda.sample.builder import build_sampling_metadata, make_generator
from pagoda.sampling_params import SamplingParams as SP

V = 50


def test_all_greedy_batch_leaves_every_optional_field_empty(build):
    md = build([SP(temperature=0.0), SP(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)], V,
               outputs=[[1], [2]], eos=[7])
    assert md.all_greedy and not md.all_random
    assert torch.equal(md.temperature, torch.zeros(2))
    # Truncation only matters for random rows, so greedy rows never create the tensors.
    assert md.top_p is None and md.top_k is None and md.min_p is None
    assert md.no_penalties
    assert md.presence_penalties is None and md.frequency_penalties is None
    assert md.repetition_penalties is None
    assert md.min_tokens == {} and md.logit_bias == {} and md.max_num_logprobs is None


def test_random_rows_fill_truncation_with_neutral_values_elsewhere(build):
    md = build([SP(temperature=0.7, top_k=5), SP(temperature=0.0, top_k=3), SP(top_p=0.9)], V)
    assert not md.all_greedy and not md.all_random
    assert torch.allclose(md.temperature, torch.tensor([0.7, 0.0, 1.0]))
    assert md.top_k.tolist() == [5, V, V]  # 0 (disabled) and greedy rows -> V
    assert md.top_k.dtype == torch.int64
    assert torch.allclose(md.top_p, torch.tensor([1.0, 1.0, 0.9]))
    assert md.min_p is None


def test_top_k_at_least_vocab_size_counts_as_unused(build):
    md = build([SP(top_k=V), SP(top_k=V + 10)], V)
    assert md.all_random and md.top_k is None


def test_any_penalty_builds_all_three_tensors(build):
    params = [SP(), SP(repetition_penalty=1.2), SP(frequency_penalty=0.5, presence_penalty=-1)]
    md = build(params, V)
    assert not md.no_penalties
    assert torch.allclose(md.repetition_penalties, torch.tensor([1.0, 1.2, 1.0]))
    assert torch.allclose(md.frequency_penalties, torch.tensor([0.0, 0.0, 0.5]))
    assert torch.allclose(md.presence_penalties, torch.tensor([0.0, 0.0, -1.0]))


def test_min_tokens_rows_only_while_short_with_eos_and_stop_ids(build):
    params = [
        SP(min_tokens=3, stop_token_ids=[4]),  # short: eos + stop id
        SP(min_tokens=2),  # already has 2 outputs: nothing to suppress
        SP(min_tokens=3, ignore_eos=True, stop_token_ids=[9]),  # EOS ends nothing here
        SP(min_tokens=3, ignore_eos=True),  # nothing would stop it: no entry
        SP(min_tokens=5, stop_token_ids=[V + 3]),  # out-of-vocab id dropped
    ]
    md = build(params, V, outputs=[[1], [1, 2], [], [], []], eos=[7])
    assert md.min_tokens == {0: (3, {4, 7}), 2: (3, {9}), 4: (5, {7})}


def test_logit_bias_and_max_num_logprobs(build):
    params = [SP(logit_bias={3: 2.5, V: 9.0, -1: 1.0}, logprobs=2), SP(logprobs=5), SP()]
    md = build(params, V)
    assert md.logit_bias == {0: {3: 2.5}}  # ids outside the vocabulary cannot be sampled
    assert md.max_num_logprobs == 5
    assert build([SP(logprobs=0)], V).max_num_logprobs == 0


def test_generators_of_greedy_rows_are_dropped(build):
    g0, g1 = make_generator(1), make_generator(2)
    md = build([SP(temperature=0.0, seed=1), SP(seed=2)], V, generators={0: g0, 1: g1})
    assert md.generators == {1: g1}


def test_token_lists_are_passed_through_row_aligned(build):
    md = build([SP(), SP()], V, prompts=[[1, 2], [3]], outputs=[[4], []])
    assert md.prompt_token_ids == [[1, 2], [3]] and md.output_token_ids == [[4], []]


def test_row_count_mismatch_raises():
    with pytest.raises(ValueError, match="one entry per row"):
        build_sampling_metadata([SP(), SP()], [[]], [[], []], {}, V, [[], []])


def test_make_generator_is_seeded():
    a = torch.rand(5, generator=make_generator(42))
    b = torch.rand(5, generator=make_generator(42))
    c = torch.rand(5, generator=make_generator(43))
    assert torch.equal(a, b) and not torch.equal(a, c)

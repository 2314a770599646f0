"""Repetition, frequency and presence penalties change logits exactly as defined."""

from __future__ import annotations

import pytest
import torch

from pagoda.sample.penalties import apply_penalties
from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams as SP

V = 8
BASE = [3.0, 2.0, -1.0, 4.0, 0.5, -2.0, 1.0, 0.0]


def _penalised(build, params, prompts, outputs):
    md = build(params, V, prompts=prompts, outputs=outputs)
    logits = torch.tensor([BASE] * len(params))
    return apply_penalties(logits, md)


def test_repetition_divides_positive_and_multiplies_negative_seen_logits(build):
    out = _penalised(build, [SP(repetition_penalty=2.0)], prompts=[[1, 2]], outputs=[[3, 3, 5]])
    expected = [3.0, 1.0, -2.0, 2.0, 0.5, -4.0, 1.0, 0.0]
    assert out.tolist() == [expected]


def test_repetition_below_one_encourages_seen_tokens(build):
    out = _penalised(build, [SP(repetition_penalty=0.5)], prompts=[[0]], outputs=[[2]])
    assert out[0, 0].item() == 6.0 and out[0, 2].item() == -0.5


def test_frequency_and_presence_follow_openai_over_output_tokens_only(build):
    params = [SP(frequency_penalty=0.5, presence_penalty=0.25)]
    out = _penalised(build, params, prompts=[[0, 1]], outputs=[[3, 3, 3, 6]])
    expected = list(BASE)
    expected[3] = 4.0 - 0.5 * 3 - 0.25  # count 3
    expected[6] = 1.0 - 0.5 * 1 - 0.25  # count 1; prompt tokens 0, 1 untouched
    assert out.tolist() == [expected]


def test_negative_penalties_reward_repeats(build):
    out = _penalised(build, [SP(frequency_penalty=-1.0, presence_penalty=-2.0)],
                     prompts=[[]], outputs=[[4, 4]])
    assert out[0, 4].item() == 0.5 + 2.0 + 2.0


def test_rows_without_penalties_are_untouched(build):
    params = [SP(), SP(repetition_penalty=1.5, frequency_penalty=1.0), SP(temperature=0.0)]
    out = _penalised(build, params, prompts=[[0, 1]] * 3, outputs=[[3]] * 3)
    assert out[0].tolist() == BASE and out[2].tolist() == BASE
    assert out[1, 0].item() == 2.0 and out[1, 3].item() == pytest.approx(4.0 / 1.5 - 1.0)


def _dense_reference(logits, prompts, outputs, rep, freq, pres):
    """vLLM's dense formulation, for comparison on random data."""
    num_rows, vocab_size = logits.shape
    counts = torch.zeros(num_rows, vocab_size)
    prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool)
    for row in range(num_rows):
        for t in outputs[row]:
            counts[row, t] += 1
        prompt_mask[row, prompts[row]] = True
    output_mask = counts > 0
    r = rep.unsqueeze(1).repeat(1, vocab_size)
    r[~(prompt_mask | output_mask)] = 1.0
    logits = torch.where(logits > 0, logits / r, logits * r)
    logits = logits - freq.unsqueeze(1) * counts
    return logits - pres.unsqueeze(1) * output_mask


def test_matches_dense_reference_on_random_batch(build):
    gen = torch.Generator().manual_seed(0)
    num_rows, vocab_size = 16, 300
    params = [SP(repetition_penalty=1.0 + 0.1 * (i % 4), frequency_penalty=0.3 * (i % 3),
                 presence_penalty=-0.2 * (i % 2)) for i in range(num_rows)]
    prompts = [torch.randint(0, vocab_size, (20,), generator=gen).tolist() for _ in params]
    outputs = [torch.randint(0, vocab_size, (i * 3,), generator=gen).tolist()
               for i in range(num_rows)]
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 3
    md = build(params, vocab_size, prompts=prompts, outputs=outputs)
    out = apply_penalties(logits.clone(), md)
    expected = _dense_reference(logits, prompts, outputs, md.repetition_penalties,
                                md.frequency_penalties, md.presence_penalties)
    assert torch.allclose(out, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(out, logits)


def test_greedy_row_argmax_sees_the_penalty(build):
    logits = torch.tensor([BASE, BASE])
    md = build([SP(temperature=0.0, repetition_penalty=3.0), SP(temperature=0.0)], V,
               prompts=[[3], [3]], outputs=[[], []])
    sampled = Sampler()(logits, md).sampled_token_ids
    assert sampled.tolist() == [0, 3]  # 4/3 < 3, so token 0 wins in the penalised row
    assert logits.tolist() == [BASE, BASE]  # the caller's logits are not modified

"""logit_bias and min_tokens, on the logits and on what the sampler picks."""

from __future__ import annotations

import torch

from pagoda.sample.processors import apply_logit_bias, apply_min_tokens
from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams as SP

V = 6
EOS = 5
# EOS is the most likely token, so an unconstrained greedy row would stop at once.
LOGITS = [1.0, 0.5, 2.0, -1.0, 0.0, 4.0]


def test_logit_bias_adds_to_the_named_tokens_of_its_row(build):
    md = build([SP(logit_bias={0: 1.5, 3: -100.0}), SP()], V)
    out = apply_logit_bias(torch.tensor([LOGITS, LOGITS]), md)
    assert out[0].tolist() == [2.5, 0.5, 2.0, -101.0, 0.0, 4.0]
    assert out[1].tolist() == LOGITS


def test_logit_bias_steers_greedy_and_can_ban_a_token(build):
    md = build([SP(temperature=0.0, logit_bias={1: 10.0}), SP(logit_bias={EOS: -100.0})], V)
    torch.manual_seed(0)
    logits = torch.tensor([LOGITS] * 2)
    assert Sampler()(logits, md).sampled_token_ids[0].item() == 1
    many = build([SP(logit_bias={EOS: -100.0})] * 2000, V)
    sampled = Sampler()(torch.tensor([LOGITS] * 2000), many).sampled_token_ids
    assert EOS not in sampled.tolist() and len(set(sampled.tolist())) > 2


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached(build):
    params = [SP(temperature=0.0, min_tokens=2, stop_token_ids=[2])] * 3
    md = build(params, V, outputs=[[], [1], [1, 1]], eos=[EOS])
    out = apply_min_tokens(torch.tensor([LOGITS] * 3), md)
    inf = float("inf")
    assert out[0].tolist() == [1.0, 0.5, -inf, -1.0, 0.0, -inf]
    assert out[1].tolist() == out[0].tolist()
    assert out[2].tolist() == LOGITS  # min_tokens reached: nothing suppressed
    assert Sampler()(torch.tensor([LOGITS] * 3), md).sampled_token_ids.tolist() == [0, 0, EOS]


def test_min_tokens_with_ignore_eos_still_suppresses_stop_ids(build):
    md = build([SP(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[2])], V,
               outputs=[[]], eos=[EOS])
    logits = torch.tensor([[1.0, 0.5, 9.0, -1.0, 0.0, 4.0]])
    # EOS does not end an ignore_eos request, so it may be chosen; the stop id may not.
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [EOS]


def test_min_tokens_rechecks_output_lists_that_grow_in_place(build):
    outputs = [[]]
    md = build([SP(temperature=0.0, min_tokens=1)], V, outputs=outputs, eos=[EOS])
    assert Sampler()(torch.tensor([LOGITS]), md).sampled_token_ids.item() == 2
    outputs[0].append(2)
    assert Sampler()(torch.tensor([LOGITS]), md).sampled_token_ids.item() == EOS


def test_min_tokens_holds_for_random_rows(build):
    torch.manual_seed(0)
    md = build([SP(temperature=1.5, min_tokens=4)] * 2000, V, eos=[EOS])
    sampled = Sampler()(torch.tensor([LOGITS] * 2000), md).sampled_token_ids.tolist()
    assert EOS not in sampled and set(sampled) == {0, 1, 2, 3, 4}

"""The beam search rule (pagoda/beam_search.py) on scripted candidates: vLLM's choices."""

from __future__ import annotations

import pytest

from pagoda.beam_search import (BeamSearchInstance, BeamSearchParams, best_beams, expand_beams,
                                generated_tokens, get_beam_search_score, step_sampling_params)

EOS = [2]


def test_score_counts_the_prompt_and_not_a_final_eos():
    assert get_beam_search_score([5, 6, 7, 8], -8.0, EOS, 1.0) == -2.0
    assert get_beam_search_score([5, 6, 7, 2], -6.0, EOS, 1.0) == -2.0
    assert get_beam_search_score([5, 6, 7, 8], -8.0, EOS, 0.0) == -8.0


def test_step_keeps_the_best_live_beams_and_every_eos_candidate():
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0)
    inst = BeamSearchInstance([9, 9])
    expand_beams(inst, [{10: -0.1, 11: -0.5, 12: -0.7, 2: -3.0}], params, EOS)
    assert [b.tokens for b in inst.beams] == [[9, 9, 10], [9, 9, 11]]
    # vLLM keeps an EOS candidate whatever its rank among the 2k.
    assert [(b.tokens, b.finish_reason) for b in inst.completed] == [([9, 9, 2], "stop")]
    expand_beams(inst, [{13: -4.0, 14: -4.5}, {15: -0.2, 16: -5.0}], params, EOS)
    assert [b.tokens[2:] for b in inst.beams] == [[11, 15], [10, 13]]
    assert inst.beams[0].cum_logprob == pytest.approx(-0.7)
    best = best_beams(inst, params, EOS)
    assert [(b.tokens[2:], b.finish_reason) for b in best] == [([11, 15], "length"),
                                                               ([2], "stop")]


def test_ignore_eos_keeps_eos_beams_alive():
    params = BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True)
    inst = BeamSearchInstance([9])
    expand_beams(inst, [{2: -0.1, 10: -0.5}], params, EOS)
    assert inst.completed == [] and inst.beams[0].tokens == [9, 2]


def test_served_tokens_drop_the_eos_unless_asked():
    params = BeamSearchParams(beam_width=1, max_tokens=2)
    inst = BeamSearchInstance([9])
    expand_beams(inst, [{2: -0.1, 10: -0.5}], params, EOS)
    (eos_beam,) = inst.completed
    assert generated_tokens(eos_beam, 1, params) == []
    keep = BeamSearchParams(beam_width=1, max_tokens=2, include_stop_str_in_output=True)
    assert generated_tokens(eos_beam, 1, keep) == [2]


def test_step_requests_ask_for_2k_logprobs_of_one_token():
    params = step_sampling_params(BeamSearchParams(beam_width=3, max_tokens=9, temperature=0.5))
    assert (params.logprobs, params.max_tokens, params.temperature) == (6, 1, 0.5)


@pytest.mark.parametrize("kwargs, field", [
    ({"beam_width": 0, "max_tokens": 1}, "beam_width"),
    ({"beam_width": 1.5, "max_tokens": 1}, "beam_width"),
    ({"beam_width": 1, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 1, "max_tokens": 1, "temperature": -1}, "temperature"),
    ({"beam_width": 1, "max_tokens": 1, "length_penalty": float("nan")}, "length_penalty"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)

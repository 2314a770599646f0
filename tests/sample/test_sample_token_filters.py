"""allowed_token_ids and bad_words (vLLM's), on the logits and on what the sampler picks."""

from __future__ import annotations

import pytest
import torch

from pagoda.sample.processors import apply_allowed_token_ids, apply_bad_words
from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams as SP

V = 6
LOGITS = [1.0, 0.5, 2.0, -1.0, 0.0, 4.0]  # token 5 is the argmax, then 2
NEG = float("-inf")


def test_allowed_token_ids_leave_only_those_tokens_in_their_row(build):
    md = build([SP(allowed_token_ids=[1, 3]), SP()], V)
    out = apply_allowed_token_ids(torch.tensor([LOGITS, LOGITS]), md)
    assert out[0].tolist() == [NEG, 0.5, NEG, -1.0, NEG, NEG]
    assert out[1].tolist() == LOGITS


def test_sampling_never_leaves_the_allowed_set(build):
    torch.manual_seed(0)
    params = [SP(temperature=1.0, allowed_token_ids=[0, 3])] * 500 + [SP(temperature=0.0,
                                                                         allowed_token_ids=[1, 3])]
    sampled = Sampler()(torch.tensor([LOGITS] * 501), build(params, V)).sampled_token_ids.tolist()
    assert set(sampled[:500]) == {0, 3}  # both allowed tokens are drawn, nothing else
    assert sampled[500] == 1  # greedy: the best allowed token, not the argmax


def test_a_one_token_bad_word_is_always_banned(build):
    md = build([SP(temperature=0.0, bad_words_token_ids=[[5]])], V)
    assert Sampler()(torch.tensor([LOGITS]), md).sampled_token_ids.item() == 2


def test_a_longer_bad_word_bans_its_last_token_only_where_it_would_complete(build):
    words = [[1, 2, 5]]
    completes = build([SP(bad_words_token_ids=words)], V, outputs=[[4, 1, 2]])
    assert apply_bad_words(torch.tensor([LOGITS]), completes)[0].tolist() == LOGITS[:5] + [NEG]
    for past in ([], [1], [2, 1], [1, 2, 3]):  # the prefix is not what the output ends with
        md = build([SP(bad_words_token_ids=words)], V, outputs=[past])
        assert apply_bad_words(torch.tensor([LOGITS]), md)[0].tolist() == LOGITS, past


def test_bad_words_match_the_output_only_not_the_prompt(build):
    md = build([SP(bad_words_token_ids=[[1, 5]])], V, prompts=[[3, 1]], outputs=[[]])
    assert apply_bad_words(torch.tensor([LOGITS]), md)[0].tolist() == LOGITS


def test_out_of_vocabulary_words_and_ids_are_dropped(build):
    md = build([SP(bad_words_token_ids=[[99], [1, 99]], allowed_token_ids=[2, 99])], V)
    assert not md.bad_words_token_ids and md.allowed_token_ids == {0: [2]}


@pytest.mark.parametrize("kwargs, message", [
    ({"allowed_token_ids": []}, "allowed_token_ids is not None and empty!"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids contains out-of-vocab token id!"),
    ({"bad_words": [""]}, "bad_words must be a list of non-empty strings."),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1 or -1"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be an integer >= 1 or -1"),
])
def test_invalid_values_are_refused_with_vllm_messages(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SP(**kwargs)

"""compare.first_difference: silent on equal answers, and names the first differing token,
a logprob out of tolerance, a different top-logprob set and a length mismatch."""

from __future__ import annotations

from compare import Answer, Choice, first_difference



def answer(ids=(5, 6, 7), logprobs=(-0.5, -1.0, -1.5), top=None, prompt_tokens=4) -> Answer:
    top = top if top is not None else [{t: lp, 99: lp - 1} for t, lp in zip(ids, logprobs)]
    return Answer([Choice(list(ids), list(logprobs), top)], prompt_tokens)


def test_equal_answers_have_no_difference():
    assert first_difference(answer(), answer()) is None


def test_logprobs_within_tolerance_are_equal():
    nudged = answer(logprobs=(-0.5 + 5e-5, -1.0, -1.5 - 5e-5))
    nudged.choices[0].top = answer().choices[0].top
    assert first_difference(answer(), nudged, tol=1e-4) is None


def test_a_differing_token_is_named_with_index_and_both_ids():
    found = first_difference(answer(), answer(ids=(5, 8, 7)),
                             decode=lambda ids: f"<{ids[0]}>")
    assert found == ("choice 0: first differing token at index 1: expected 6 '<6>', "
                     "got 8 '<8>'")


def test_a_logprob_out_of_tolerance_fails():
    found = first_difference(answer(), answer(logprobs=(-0.5, -1.0, -1.5003)), tol=1e-4)
    assert found is not None and found.startswith("choice 0: logprob of token 2")


def test_a_top_logprob_out_of_tolerance_fails():
    got = answer()
    got.choices[0].top[1][99] += 1e-3
    found = first_difference(answer(), got, tol=1e-4)
    assert found is not None and "top logprob of 99 at token 1" in found


def test_a_different_top_set_fails():
    got = answer()
    got.choices[0].top[0] = {5: -0.5, 98: -1.5}
    assert "top logprobs at token 0" in first_difference(answer(), got)


def test_zero_tolerance_means_bit_equal():
    assert first_difference(answer(), answer(logprobs=(-0.5, -1.0, -1.5 + 1e-12)),
                            tol=0.0) is not None


def test_a_shorter_answer_and_a_choice_count_and_prompt_length_fail():
    assert "lengths differ" in first_difference(answer(), answer(ids=(5, 6),
                                                                 logprobs=(-0.5, -1.0)))
    two = Answer(answer().choices * 2, 4)
    assert first_difference(answer(), two) == "choices: expected 1, got 2"
    assert first_difference(answer(), answer(prompt_tokens=5)) == \
        "prompt tokens: expected 4, got 5"


def test_a_masked_token_is_minus_inf_offline_and_minus_9999_served():
    want, got = answer(), answer()
    want.choices[0].top[0][99] = float("-inf")
    got.choices[0].top[0][99] = -9999.0
    assert first_difference(want, got) is None
    got.choices[0].top[0][99] = -50.0  # a real logprob where the reference masked
    assert "top logprob of 99 at token 0" in first_difference(want, got)

"""`Request.append_token_and_check_stop` (the scheduler's one-token decode path) ends a
request exactly where `append_output_token` then `check_stop` would, for every stop rule."""

from __future__ import annotations

import itertools

from pagoda.core.request import Request
from pagoda.messages import EngineCoreRequest, FinishReason
from pagoda.sampling_params import SamplingParams

EOS = 2
# Sampled tokens that hit each rule: EOS, a stop token (9), a repeat (5 5 5 5), plain ones.
STREAM = [7, 5, 5, 5, 5, 9, 2, 8, 8, 3]


def _pair(**params) -> tuple[Request, Request]:
    def make():
        core = EngineCoreRequest("r", [11, 12, 13], SamplingParams(**params), [EOS])
        return Request(core, block_size=4, hash_seed="seed", max_model_len=64)
    return make(), make()


def test_the_one_call_stops_where_the_two_calls_stop():
    cases = itertools.product(
        (False, True),  # ignore_eos
        ((), (9,)),  # stop_token_ids
        (0, 3),  # min_tokens
        (4, 6, 20),  # max_tokens
        (None, {"max_pattern_size": 1, "min_count": 4}),  # repetition_detection
    )
    checked = set()
    for ignore_eos, stop, min_tokens, max_tokens, repetition in cases:
        fast, slow = _pair(ignore_eos=ignore_eos, stop_token_ids=list(stop),
                           min_tokens=min_tokens, max_tokens=max_tokens,
                           repetition_detection=repetition)
        for token in STREAM:
            ended = fast.append_token_and_check_stop(token)
            slow.append_output_token(token)
            assert ended == slow.check_stop()
            assert (fast.finish_reason, fast.stop_reason) == (slow.finish_reason,
                                                             slow.stop_reason)
            assert fast.block_hashes == slow.block_hashes
            if ended:
                checked.add(fast.finish_reason)
                break
        assert fast.output_token_ids == slow.output_token_ids
    assert checked == {FinishReason.STOP, FinishReason.LENGTH, FinishReason.REPETITION}

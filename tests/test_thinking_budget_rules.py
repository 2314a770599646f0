"""The pure rules behind thinking_token_budget, --reasoning-config and
repetition_detection: budget_state, ReasoningConfig, the params' validation, the
wire round trip, and check_sequence_repetition. No model: seconds."""

from __future__ import annotations

import pytest

from pagoda import SamplingParams
from pagoda.reasoning.budget import ReasoningConfig, budget_state
from pagoda.repetition_detection import RepetitionDetectionParams, check_sequence_repetition

S, E = [90, 91], [92, 93, 94]  # multi-token markers: <think> / </think> in SmolLM2 are 3 each


@pytest.mark.parametrize("tokens, budget, forced, free", [
    ([1, 2, 3], 4, None, None),                        # no marker: not thinking
    ([1, *S], 4, None, 4),                             # the prompt opened the block
    ([1, *S, 7, 7, 7], 4, None, 1),
    ([1, *S, 7, 7, 7, 7], 4, 92, 0),                   # budget spent: the end marker, token 1
    ([1, *S, 7, 7, 7, 7, 92], 4, 93, 0),               # ... token 2
    ([1, *S, 7, 7, 7, 7, 92, 93], 4, 94, 0),           # ... token 3
    ([1, *S, 7, 7, 7, 7, *E], 4, None, None),          # closed: the answer is free
    ([1, *S, 7, *E, 5], 4, None, None),                # closed early by the model
    ([1, *S, *E, 5, *S], 0, 92, 0),                    # a block opened again, budget 0
    ([1, *S, 7, 92, 7], 4, None, 1),                   # half an end marker is no marker
])
def test_budget_state(tokens, budget, forced, free):
    state = budget_state(tokens, budget, S, E)
    assert (state.forced, state.free) == (forced, free)


def test_reasoning_config_parse_and_resolve():
    config = ReasoningConfig.parse('{"think_start_str": "<think>", "think_end_str": "</think>"}')
    config.resolve({"<think>": [5, 6], "</think>": [7, 8]}.__getitem__, vocab_size=100)
    assert (config.think_start_token_ids, config.think_end_token_ids) == ([5, 6], [7, 8])
    ids = ReasoningConfig.parse({"think_start_token_ids": [3], "think_end_token_ids": [4]})
    assert ids.resolve(lambda text: pytest.fail("no tokenizer needed"), 10).think_end_token_ids == [4]
    assert ReasoningConfig.parse(None) is None
    with pytest.raises(ValueError, match="unknown key.*think_start"):
        ReasoningConfig.parse('{"think_start": "<think>"}')
    with pytest.raises(ValueError, match="think_end_str"):
        ReasoningConfig.parse('{"think_start_str": "<think>"}')
    with pytest.raises(ValueError, match="not token ids of this model"):
        ReasoningConfig.parse({"think_start_token_ids": [3], "think_end_token_ids": [400]}
                              ).resolve(lambda t: [], 10)


def test_params_validate_both_fields_by_name():
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # unlimited
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    detection = SamplingParams(repetition_detection={"max_pattern_size": 4, "min_count": 3})
    assert detection.repetition_detection == RepetitionDetectionParams(4, 0, 3)
    for kwargs, field in [(dict(thinking_token_budget=-2), "thinking_token_budget"),
                          (dict(thinking_token_budget=1.5), "thinking_token_budget"),
                          (dict(repetition_detection={"max_pattern_size": 4, "min_count": 1}),
                           "repetition_detection.min_count"),
                          (dict(repetition_detection={"max_pattern_size": 2, "min_pattern_size": 3,
                                                      "min_count": 2}),
                           "repetition_detection.max_pattern_size"),
                          (dict(repetition_detection={"max_pattern": 2}),
                           "repetition_detection.max_pattern ")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_both_fields_cross_the_wire():
    from pagoda.services.common.protocol.sampling_params import (sampling_params_from_proto,
                                                                 sampling_params_to_proto)

    params = SamplingParams(thinking_token_budget=7,
                            repetition_detection={"max_pattern_size": 5, "min_pattern_size": 2,
                                                  "min_count": 3})
    back = sampling_params_from_proto(sampling_params_to_proto(params, for_worker=True))
    assert back.thinking_token_budget == 7
    assert back.repetition_detection == RepetitionDetectionParams(5, 2, 3)
    plain = sampling_params_from_proto(sampling_params_to_proto(SamplingParams()))
    assert plain.thinking_token_budget is None and plain.repetition_detection is None


@pytest.mark.parametrize("tokens, params, found", [
    ([1, 2, 3, 1, 2, 3, 1, 2, 3], RepetitionDetectionParams(3, 0, 3), True),
    ([1, 2, 3, 1, 2, 3, 1, 2], RepetitionDetectionParams(3, 0, 3), False),   # not at the end
    ([9, 1, 2, 3, 1, 2, 3], RepetitionDetectionParams(3, 0, 3), False),      # only twice
    ([5, 5, 5], RepetitionDetectionParams(2, 0, 3), True),
    ([5, 5, 5], RepetitionDetectionParams(3, 2, 3), False),                  # too short a pattern
    ([1, 2, 3, 4, 1, 2, 3, 4], RepetitionDetectionParams(3, 1, 2), False),   # too long a pattern
    ([1, 2, 1, 2], RepetitionDetectionParams(0, 0, 0), False),               # off
])
def test_check_sequence_repetition(tokens, params, found):
    assert check_sequence_repetition(tokens, params) is found


def test_drafts_are_cut_where_the_budget_forces_the_end_marker():
    from types import SimpleNamespace

    from pagoda.spec_decode.budget_cut import ThinkingBudgetDrafts

    hook = ThinkingBudgetDrafts(ReasoningConfig(think_start_token_ids=S, think_end_token_ids=E))

    def cut(tokens, budget, drafts):
        request = SimpleNamespace(all_token_ids=tokens, spec_token_ids=list(drafts),
                                  sampling_params=SamplingParams(thinking_token_budget=budget))
        hook.after_step(request, None, 1)
        return request.spec_token_ids

    assert cut([1, *S, 7], 4, [8, 8, 8, 8]) == [8, 8, 8]      # 3 free tokens left
    assert cut([1, *S, 7, 7, 7, 7], 4, [92, 93]) == []         # forcing: no draft verified
    assert cut([1, *S, 7, *E], 4, [8, 8, 8, 8]) == [8, 8, 8, 8]  # the answer: uncapped
    assert cut([1, *S, 7], None, [8, 8, 8, 8]) == [8, 8, 8, 8]   # no budget

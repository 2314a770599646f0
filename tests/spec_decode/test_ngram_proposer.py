"""Prompt-lookup drafts and vLLM's --speculative-config parsing."""

import pytest

from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.spec_decode.ngram_proposer import NgramProposer


def test_drafts_follow_the_latest_occurrence_of_the_longest_suffix():
    proposer = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    # "7 8" occurs twice before the end; the 2-gram beats the 1-gram "8" and the
    # latest occurrence (followed by 5 6 1) wins over the first (followed by 1 2 3).
    tokens = [7, 8, 1, 2, 3, 9, 7, 8, 5, 6, 1, 4, 7, 8]
    assert proposer.propose(tokens) == [5, 6, 1]


def test_longer_match_wins_even_when_older():
    proposer = NgramProposer(2, prompt_lookup_min=1, prompt_lookup_max=3)
    tokens = [1, 2, 3, 10, 11, 3, 20, 21, 1, 2, 3]
    assert proposer.propose(tokens) == [10, 11]  # "1 2 3" beats the later "3"


def test_a_repeating_pattern_is_continued_periodically():
    proposer = NgramProposer(5, prompt_lookup_min=2, prompt_lookup_max=2)
    assert proposer.propose([4, 5, 6, 4, 5]) == [6, 4, 5, 6, 4]
    assert proposer.propose([1, 1, 1]) == [1, 1, 1, 1, 1]


def test_no_match_or_no_room_gives_no_drafts():
    proposer = NgramProposer(4, prompt_lookup_min=2, prompt_lookup_max=3)
    assert proposer.propose([1, 2, 3, 4, 5, 6]) == []
    assert proposer.propose([1, 2]) == []
    assert proposer.propose([1, 2, 9, 1, 2], max_drafts=0) == []
    assert proposer.propose([1, 2, 9, 8, 1, 2], max_drafts=1) == [9]


def test_config_defaults_and_vllm_spellings():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min,
            config.prompt_lookup_max) == (3, 5, 5)
    config = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2,
                                      "prompt_lookup_max": 4})
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 4, 4)
    assert SpeculativeConfig.parse(None) is None
    draft = SpeculativeConfig.parse({"model": "org/draft", "num_speculative_tokens": 2})
    assert (draft.method, draft.model, draft.uses_draft_model) == ("draft_model", "org/draft",
                                                                   True)


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram"', "not valid JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
    ('{"method": "ngram", "model": "org/draft", "num_speculative_tokens": 2}',
     "the ngram method takes none"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "unsupported key(s) ['foo']"),
])
def test_config_errors_name_the_problem(value, message):
    with pytest.raises(ValueError, match=None) as info:
        SpeculativeConfig.parse(value)
    assert message in str(info.value)

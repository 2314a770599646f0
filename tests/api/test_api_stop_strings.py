"""Stop strings with min_tokens through the gateway and the real tokenizer service (fakes
for the scheduler): the served text is the one the library decoder gives offline."""

from __future__ import annotations

import pytest
from api_fakes import MODEL, SCRIPT
from completion_result import completion_result


def served(client, stream: bool, **params):
    """(text, finish_reason, stop_reason, completion_tokens) of one completion."""
    kwargs = dict(model=MODEL, prompt="Hi", max_tokens=19, stop=params.pop("stop"),
                  extra_body=params)
    return completion_result(client, stream, **kwargs)


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_ignores_a_stop_string_in_the_first_tokens(client, smollm2_tokenizer, stream):
    tok = smollm2_tokenizer
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    assert tok.decode(ids[:2]) == " The answer"  # two "e"s inside the first two tokens
    assert served(client, stream, stop=["e"]) == (" Th", "stop", "e", 1)
    # With min_tokens=2 the first "e" that counts is the one of " the" (token 9).
    cut = SCRIPT.index("e", len(" The answer"))
    assert tok.decode(ids[:9]).endswith(" the") and cut == len(tok.decode(ids[:9])) - 1
    assert served(client, stream, stop=["e"], min_tokens=2) == (SCRIPT[:cut], "stop", "e", 9)


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_past_every_match_runs_to_the_length_limit(client, stream):
    """'END' only occurs inside the first 7 tokens: with min_tokens=7 nothing stops."""
    assert served(client, stream, stop=["END"], min_tokens=7) == (SCRIPT, "length", None, 19)

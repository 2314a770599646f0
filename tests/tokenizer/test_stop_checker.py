"""StopChecker: which stop string completes first, where the text is cut, and how much
of the text's end could still become a stop string."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.tokenizer.stop_checker import StopChecker


def test_stop_before_or_after_depending_on_include_stop_str_in_output():
    text = "The answer is 42.\nDone"
    assert StopChecker(["\n"]).check(text, 6) == ("\n", 17)
    assert StopChecker(["\n"], include_stop_str_in_output=True).check(text, 6) == ("\n", 18)


def test_no_match_returns_the_whole_length():
    assert StopChecker(["STOP"]).check("nothing here", 4) == (None, 12)
    assert StopChecker([]).check("anything", 8) == (None, 8)


def test_only_matches_touching_new_chars_are_reported():
    # "ab" lies wholly in text an earlier call already checked.
    assert StopChecker(["ab"]).check("ab cd", 2) == (None, 5)
    # A match that spans old and new chars is found.
    assert StopChecker(["b c"]).check("ab cd", 2) == ("b c", 1)


def test_stop_at_the_very_start():
    assert StopChecker(["Hello"]).check("Hello world", 11) == ("Hello", 0)


def test_earliest_completed_match_wins_whatever_the_list_order():
    text = "xx END yy STOP"
    for stop in (["STOP", "END"], ["END", "STOP"]):
        assert StopChecker(stop).check(text, len(text)) == ("END", 3)
    # "b" completes before "abc" does, so "b" wins although "abc" starts earlier.
    assert StopChecker(["abc", "b"]).check("xabc", 4) == ("b", 2)
    # Both complete at the same char: the longer one (earlier start) wins.
    assert StopChecker(["bc", "abc"]).check("xabc", 4) == ("abc", 1)


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="stop"):
        StopChecker(["ok", ""])


def test_partial_match_len():
    checker = StopChecker(["</answer>", "###"])
    assert checker.partial_match_len("the result </ans") == len("</ans")
    assert checker.partial_match_len("header ##") == 2
    assert checker.partial_match_len("plain text") == 0
    assert checker.partial_match_len("") == 0
    # A complete stop string is a match, not a partial one.
    assert StopChecker(["ab"]).partial_match_len("xab") == 0
    # The longest suffix counts, not the first stop string that fits.
    assert StopChecker(["x", "aab"]).partial_match_len("caa") == 2


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab \n", max_size=30),
    stop=st.lists(st.text(alphabet="ab \n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=6),
    include=st.booleans(),
)
def test_chunked_checks_match_a_character_by_character_scan(first_stop_by_chars, text, stop, cuts, include):
    """Feeding the text in any chunks, the first reported match is the reference's, and
    the held-back suffix always covers the part of a future match already seen."""
    checker = StopChecker(stop, include)
    expected = first_stop_by_chars(text, stop)
    bounds = sorted({min(c, len(text)) for c in cuts} | {len(text)})
    prev, found = 0, None
    for end in bounds:
        if end == prev:
            continue
        stop_str, length = checker.check(text[:end], end - prev)
        if stop_str is not None:
            found = (stop_str, length)
            break
        assert length == end
        if expected is not None:
            # Text before the hold-back is streamed; it must end before the future match.
            assert end - checker.partial_match_len(text[:end]) <= expected[1]
        prev = end
    if expected is None:
        assert found is None
    else:
        s, start = expected
        assert found == (s, start + len(s) if include else start)

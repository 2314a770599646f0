"""bad_words encoding and prompt truncation: the rules the gateway and the offline engine share."""

from __future__ import annotations

import pytest

from pagoda.tokenizer.bad_words import bad_word_texts, bad_words_token_ids
from pagoda.tokenizer.truncation import resolve_truncation, truncate_prompt


def test_a_word_is_banned_as_written_and_after_a_space(smollm2_tokenizer):
    tok = smollm2_tokenizer
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    words = bad_words_token_ids(["  hello"], encode, len(tok))
    assert encode("hello") in words and encode(" hello") in words
    assert encode("hello") != encode(" hello")
    assert bad_word_texts(["  hello", "hello"]) == ["hello", " hello"]


def test_the_spaced_form_is_skipped_when_it_is_the_same_word_token():
    # A tokenizer where " x" encodes like "x" (same first token): one sequence, not two.
    codes = {"x": [7], " x": [7], "ab": [1, 2], " ab": [3]}
    assert bad_words_token_ids(["x", "ab"], codes.__getitem__) == [[7], [1, 2]]


def test_whitespace_only_words_ban_nothing_and_vocab_is_checked():
    codes = {"": [], " ": [4]}
    assert bad_words_token_ids(["   "], codes.__getitem__) == [[4]]
    with pytest.raises(ValueError, match="The model vocabulary size is 3"):
        bad_words_token_ids(["z"], {"z": [5], " z": [6]}.__getitem__, vocab_size=3)


def test_truncation_keeps_the_last_tokens():
    assert truncate_prompt([1, 2, 3, 4, 5], 2, 100) == [4, 5]
    assert truncate_prompt([1, 2, 3], 10, 100) == [1, 2, 3]
    assert truncate_prompt([1, 2, 3], -1, 2) == [2, 3]  # -1: the context length
    assert truncate_prompt([1, 2, 3], None, 2) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens value \(9\) is greater than "
                                         r"max_model_len \(8\)"):
        resolve_truncation(9, 8)

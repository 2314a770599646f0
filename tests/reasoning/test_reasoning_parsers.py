"""Reasoning parsers: the text split (reasoning_content / content), streamed and not,
on the output formats of the models they are for."""

from __future__ import annotations

import random

import pytest

from pagoda.reasoning import PARSERS, get_reasoning_parser

# (parser, model output, (reasoning_content, content))
CASES = [
    # DeepSeek-R1: the template opened <think>, the model writes only the end marker.
    ("deepseek_r1", "The user asks for 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     ("The user asks for 2+2. That is 4.\n", "\n\nThe answer is 4.")),
    ("deepseek_r1", "<think>Let me think.</think>Four.", ("Let me think.", "Four.")),
    ("deepseek_r1", "Still thinking when max_tokens hit", ("Still thinking when max_tokens hit",
                                                           None)),
    ("deepseek_r1", "</think>Straight to it.", (None, "Straight to it.")),
    # Qwen3: thinks only when the answer opens <think>.
    ("qwen3", "<think>\nOkay, 2+2=4.\n</think>\n\n4", ("\nOkay, 2+2=4.\n", "\n\n4")),
    ("qwen3", "4, without thinking.", (None, "4, without thinking.")),
    ("qwen3", "<think>\ncut short", ("\ncut short", None)),
    ("qwen3", "<think>\n\n</think>\n\n{\"a\": 1}", ("\n\n", "\n\n{\"a\": 1}")),
]


@pytest.mark.parametrize("name, text, expected", CASES)
def test_split(name, text, expected):
    assert get_reasoning_parser(name).split(text) == expected


@pytest.mark.parametrize("name, text, expected", CASES)
def test_streamed_deltas_join_to_the_same_split(name, text, expected):
    """Markers split across deltas never leak into either part."""
    parser = get_reasoning_parser(name)
    rng = random.Random(7)
    for _ in range(30):
        stream, reasoning, content, i = parser.stream(), "", "", 0
        while i < len(text):
            j = i + rng.randint(1, 5)
            r, c = stream.feed(text[i:j])
            reasoning, content, i = reasoning + r, content + c, j
            assert "</think>" not in reasoning + content and "<think>" not in reasoning
        r, c = stream.finish()
        assert ((reasoning + r) or None, (content + c) or None) == expected


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
    assert set(PARSERS) == {"deepseek_r1", "qwen3"}

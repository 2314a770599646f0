"""Reasoning parsers: the text split (reasoning_content / content), streamed and not,
on the output formats of the models they are for."""

from __future__ import annotations

import random

import pytest

from pagoda.reasoning import PARSERS, get_reasoning_parser
from pagoda.structured_output.request import GateMarkers, GateState, ReasoningGate

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
    with pytest.raises(ValueError, match="deepseek_r1, glm45, gpt_oss"):
        get_reasoning_parser("nope")
    assert {"deepseek_r1", "qwen3", "granite", "glm45", "gpt_oss", "kimi", "mistral"} <= set(PARSERS)


QWEN3_THINKING_PROMPT = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
QWEN3_NO_THINKING_PROMPT = ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
                            "<think>\n\n</think>\n\n")


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_a_prompt_that_opens_the_block_starts_the_answer_in_reasoning(name):
    """Qwen3-Thinking-2507's template opens <think> itself: the model writes only the
    reasoning and `</think>`, which must not land in content."""
    text = "2+2 is 4.\n</think>\n\nFour."
    parser = get_reasoning_parser(name)
    assert parser.split(text, QWEN3_THINKING_PROMPT) == ("2+2 is 4.\n", "\n\nFour.")
    stream = parser.stream(QWEN3_THINKING_PROMPT)
    pieces = [stream.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [stream.finish()]
    assert "".join(r for r, _ in pieces) == "2+2 is 4.\n"
    assert "".join(c for _, c in pieces) == "\n\nFour."


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_a_prompt_that_closed_the_block_is_all_content(name):
    assert get_reasoning_parser(name).split("Four.", QWEN3_NO_THINKING_PROMPT) == \
        (None, "Four.")


def test_the_text_split_and_the_grammar_gate_read_the_prompt_alike():
    """The engine's token gate and the gateway's text split start in the same state."""
    start, end, other = 1, 2, 3
    parser = get_reasoning_parser("qwen3")
    for tokens, text in [([other, start], QWEN3_THINKING_PROMPT),
                         ([other, start, end], QWEN3_NO_THINKING_PROMPT),
                         ([other], "<|im_start|>assistant\n")]:
        gate = ReasoningGate(GateMarkers((start,), (end,), parser.starts_in_reasoning), tokens)
        in_reasoning = parser.starts_in_reasoning_after(text)
        assert (gate.state == GateState.REASONING) == in_reasoning

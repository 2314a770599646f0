"""granite, glm45, gpt_oss, kimi and mistral on their families' real output formats (as
vLLM's parser tests write them): the whole answer split, and the same split from deltas
cut at every kind of point (markers across deltas, one character at a time)."""

from __future__ import annotations

import random

import pytest

from pagoda.reasoning import get_reasoning_parser

GRANITE_THINK, GRANITE_ANSWER = "Here is my thought process:", "Here is my response:"
HARMONY_ANALYSIS = "<|channel|>analysis<|message|>"
HARMONY_FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>"

# (parser, model output, (reasoning_content, content))
CASES = [
    ("granite", f"{GRANITE_THINK}This is a reasoning section{GRANITE_ANSWER}This is the rest",
     ("This is a reasoning section", "This is the rest")),
    ("granite", f"{GRANITE_THINK}This\nThat{GRANITE_ANSWER}This is the rest\nThat",
     ("This\nThat", "This is the rest\nThat")),
    ("granite", f"{GRANITE_THINK}This is a reasoning section{GRANITE_ANSWER}",
     ("This is a reasoning section", None)),
    ("granite", "Here's my thought process: sum it. Here's my response: 4",
     (" sum it. ", " 4")),
    ("granite", "This is content", (None, "This is content")),
    ("granite", "Here is my answer: 4", (None, "Here is my answer: 4")),  # not the marker
    ("glm45", "<think>The user wants 2+2.</think>\n4", ("The user wants 2+2.", "\n4")),
    ("glm45", "The user wants 2+2.</think>4", ("The user wants 2+2.", "4")),
    ("glm45", "<think>cut short", ("cut short", None)),
    ("gpt_oss", f"{HARMONY_ANALYSIS}User asks 2+2. Easy.{HARMONY_FINAL}2 + 2 = 4.<|return|>",
     ("User asks 2+2. Easy.", "2 + 2 = 4.")),
    ("gpt_oss", f"{HARMONY_ANALYSIS}Need JSON.<|end|><|start|>assistant<|channel|>final "
                "<|constrain|>json<|message|>{\"a\": 1}<|return|>",
     ("Need JSON.", "{\"a\": 1}")),
    ("gpt_oss", f"{HARMONY_ANALYSIS}Call the tool.<|end|><|start|>assistant<|channel|>"
                "commentary to=functions.get_weather <|constrain|>json<|message|>"
                "{\"city\": \"Paris\"}<|call|>", ("Call the tool.", None)),
    ("gpt_oss", f"{HARMONY_ANALYSIS}still thinking <|en", ("still thinking <|en", None)),
    ("gpt_oss", "<|channel|>final<|message|>No thinking.<|return|>", (None, "No thinking.")),
    # vLLM's name for the same parser (`--reasoning-parser openai_gptoss`)
    ("openai_gptoss", f"{HARMONY_ANALYSIS}User asks 2+2.{HARMONY_FINAL}4<|return|>",
     ("User asks 2+2.", "4")),
    ("kimi", "<think>I should look it up.</think>Paris.", ("I should look it up.", "Paris.")),
    ("kimi", "<think>Need the weather.<|tool_calls_section_begin|><|tool_call_begin|>"
             "functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}"
             "<|tool_call_end|><|tool_calls_section_end|>",
     ("Need the weather.", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                           "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
                           "<|tool_calls_section_end|>")),
    ("kimi", "Paris, without thinking.", (None, "Paris, without thinking.")),
    ("mistral", "[THINK]The user asks 2+2, which is 4.[/THINK]The answer is 4.",
     ("The user asks 2+2, which is 4.", "The answer is 4.")),
    ("mistral", "[THINK]This\nThat[/THINK]This is the rest\nThat",
     ("This\nThat", "This is the rest\nThat")),
    ("mistral", "[THINK]cut short", ("cut short", None)),
    ("mistral", "No reasoning here.", (None, "No reasoning here.")),
]


@pytest.mark.parametrize("name, text, expected", CASES)
def test_split(name, text, expected):
    assert get_reasoning_parser(name).split(text) == expected


def _streamed(name: str, pieces: list[str]) -> tuple[str | None, str | None]:
    stream, reasoning, content = get_reasoning_parser(name).stream(), "", ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return (reasoning + r) or None, (content + c) or None


@pytest.mark.parametrize("name, text, expected", CASES)
def test_streamed_deltas_give_the_same_split(name, text, expected):
    """Random split points, one character at a time, and a cut inside every marker."""
    rng = random.Random(11)
    splits = [[text[i:i + 1] for i in range(len(text))]]
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        splits.append([text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        assert _streamed(name, pieces) == expected, pieces


@pytest.mark.parametrize("name, prompt, text, expected", [
    # GLM with thinking off: the template closed an empty block in the prompt.
    ("glm45", "<|assistant|>\n<think></think>\n", "Just 4.", (None, "Just 4.")),
    # Mistral's template may open [THINK] for the model.
    ("mistral", "[INST]2+2?[/INST][THINK]", "4, obviously.[/THINK]4", ("4, obviously.", "4")),
])
def test_the_prompt_decides_where_the_answer_starts(name, prompt, text, expected):
    assert get_reasoning_parser(name).split(text, prompt) == expected

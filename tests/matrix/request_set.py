"""The fixed requests every path of the differential matrix answers.

Each `MatrixRequest` is written once, in vLLM's `SamplingParams` names (`params`), and
both sides are built from it: the offline engine's SamplingParams (reference.py) and the
OpenAI body (served.py). Every request asks for the top TOP_LOGPROBS logprobs, so the
token ids and logprobs of every choice are compared, not only its text.

`column` is the check the request stands for in the printed table; "logprobs" is no
request of its own but the logprob tolerance over all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOP_LOGPROBS = 3
COLUMNS = ("greedy", "seeded", "logprobs", "n>1", "stop", "json", "tool", "prefix", "long")

# 5 full 16-token blocks shared by the two prefix requests (the second is served from
# the first's cached blocks: locally, or pulled from another replica).
SHARED = ("You are a careful assistant. Read the following notes about the harbour town "
          "of Kellmere, its fishing fleet, its lighthouse keepers, the winter storms, the "
          "market days and the old quarrels between the net makers and the boat builders "
          "before you answer. The notes follow in full: the fleet sails at dawn, the keepers "
          "change at dusk, and the storms come from the north-west in the dark months. ")
# About 480 tokens: longer than every chunk size the matrix runs (16, 64), many blocks.
LONG = " ".join(f"item{i} weighs {i % 7} kilos" for i in range(60))
JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 8}},
                   "required": ["city"]}}}]


@dataclass(frozen=True)
class MatrixRequest:
    """A completions request (`prompt`) or a chat request (`messages`, `tools`).
    `json_schema`: sent as response_format json_schema; `tool_choice`: a named or
    "required" choice (its constraint is the gateway's, see reference.py)."""

    name: str
    column: str
    params: dict[str, Any]
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    json_schema: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def seeded(self) -> bool:
        return self.params.get("temperature", 1.0) > 0


GREEDY = {"temperature": 0.0}
REQUESTS: tuple[MatrixRequest, ...] = (
    MatrixRequest("greedy", "greedy", {**GREEDY, "max_tokens": 16, "ignore_eos": True},
                  prompt="The lighthouse keeper opened the door and"),
    MatrixRequest("seeded", "seeded", {"temperature": 0.8, "seed": 1234, "max_tokens": 16,
                                       "ignore_eos": True},
                  prompt="Once upon a time, in a town by the sea,"),
    MatrixRequest("n3-seeded", "n>1", {"temperature": 0.8, "seed": 42, "n": 3,
                                       "max_tokens": 10, "ignore_eos": True},
                  prompt="List three colours:"),
    MatrixRequest("n2-greedy", "n>1", {**GREEDY, "n": 2, "max_tokens": 8, "ignore_eos": True},
                  prompt="The boat builders said"),
    # The stop string is text the tiny model writes greedily for this prompt (the
    # reference must stop on it: test_matrix checks finish_reason "stop").
    MatrixRequest("stop", "stop", {**GREEDY, "max_tokens": 40, "stop": ["Brothers"]},
                  prompt="The market opens on"),
    MatrixRequest("json", "json", {**GREEDY, "max_tokens": 12}, json_schema=JSON_SCHEMA,
                  prompt="Give a person as JSON:"),
    MatrixRequest("tool", "tool", {**GREEDY, "max_tokens": 30},
                  messages=[{"role": "user", "content": "What is the weather in Kellmere?"}],
                  tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    MatrixRequest("prefix-first", "prefix", {**GREEDY, "max_tokens": 8, "ignore_eos": True},
                  prompt=SHARED + "Who keeps the lighthouse?"),
    MatrixRequest("prefix-second", "prefix", {**GREEDY, "max_tokens": 8, "ignore_eos": True},
                  prompt=SHARED + "When is the market held?"),
    MatrixRequest("long", "long", {**GREEDY, "max_tokens": 8, "ignore_eos": True},
                  prompt=LONG),
)

"""The reasoning gate on token sequences (`ReasoningGate`, `GateMarkers`): which output
tokens reach the grammar, for single-token markers (the <think> families) and for
several-token markers with a gap (gpt-oss's `<|channel|>final ... <|message|>`).
Token ids are arbitrary small integers; no tokenizer."""

from __future__ import annotations

from pagoda.structured_output.request import GateMarkers, GateState, ReasoningGate

# Single-token markers, as <think> / </think>.
THINK, END_THINK = 1, 2
# Harmony-like: <|start|>=90, <|channel|>=91, <|message|>=92, analysis=93, final=94,
# <|constrain|>=95; text tokens are 10.. 30.
START, CHANNEL, MESSAGE, ANALYSIS, FINAL, CONSTRAIN = 90, 91, 92, 93, 94, 95
HARMONY = GateMarkers(start=(CHANNEL, ANALYSIS, MESSAGE), end=(CHANNEL, FINAL),
                      end_suffix=(MESSAGE,), end_gap=3, turn_start=(START,),
                      starts_in_reasoning=True)


def fed(gate: ReasoningGate, tokens) -> list[int]:
    """The tokens the gate lets through to the grammar."""
    return [t for t in tokens if gate.observe(t)]


def test_single_token_markers_unchanged():
    think = GateMarkers((THINK,), (END_THINK,), starts_in_reasoning=False)
    gate = ReasoningGate(think, [10, 11])
    assert gate.state == GateState.UNDECIDED and gate.start_id == THINK
    assert fed(gate, [THINK, 12, 13, END_THINK, 14, 15]) == [14, 15]
    assert gate.state == GateState.ENDED
    gate = ReasoningGate(think, [10])
    assert fed(gate, [14, THINK, 15]) == [14, THINK, 15]  # no block opened: all answer
    # The prompt's last marker decides.
    assert ReasoningGate(think, [THINK, 10]).state == GateState.REASONING
    assert ReasoningGate(think, [THINK, END_THINK, 10]).state == GateState.ENDED
    assert ReasoningGate(think, [END_THINK, THINK]).state == GateState.REASONING
    r1 = GateMarkers((THINK,), (END_THINK,), starts_in_reasoning=True)
    gate = ReasoningGate(r1, [10])
    assert gate.state == GateState.REASONING
    assert fed(gate, [12, END_THINK, END_THINK, 13]) == [END_THINK, 13]  # only the first ends


def test_the_answer_starts_after_the_whole_end_sequence():
    gate = ReasoningGate(HARMONY, [START, 20])  # `<|start|>assistant`: reasoning first
    assert gate.state == GateState.REASONING
    analysis = [CHANNEL, ANALYSIS, MESSAGE, 11, 12, 13, START, 20]
    partial = [CHANNEL, FINAL, 14, 15, 16, 17]  # a header whose <|message|> never comes
    commentary = [CHANNEL, 21, MESSAGE, 18]  # another channel's message
    answer = [10, 11, 12]
    tokens = [*analysis, *partial, *commentary, CHANNEL, FINAL, MESSAGE, *answer]
    assert fed(gate, tokens) == answer  # no marker token, no reasoning token fed
    assert gate.state == GateState.ENDED


def test_a_header_may_hold_tokens_before_its_message_within_the_gap():
    gate = ReasoningGate(HARMONY, [START, 20])
    assert fed(gate, [CHANNEL, FINAL, CONSTRAIN, 24, MESSAGE, 10]) == [10]  # 2 between
    gate = ReasoningGate(HARMONY, [START, 20])
    assert fed(gate, [CHANNEL, FINAL, 23, CONSTRAIN, 24, MESSAGE, 10]) == []  # 3: too far
    # ... and a later header still counts.
    assert fed(gate, [CHANNEL, FINAL, MESSAGE, 11]) == [11]


def test_the_prompt_decides_the_start_from_its_current_turn():
    final_turn = [START, 20, CHANNEL, FINAL, MESSAGE, 10, 11]
    # A previous turn's final answer does not count: the new turn reasons first.
    assert ReasoningGate(HARMONY, [*final_turn, START, 20]).state == GateState.REASONING
    # A prompt prefilled up to the final header starts in the answer.
    gate = ReasoningGate(HARMONY, [START, 20, START, 20, CHANNEL, FINAL, MESSAGE])
    assert gate.state == GateState.ENDED and fed(gate, [10]) == [10]
    # A header the prompt began completes in the output (vLLM searches prompt + output).
    gate = ReasoningGate(HARMONY, [START, 20, CHANNEL, FINAL])
    assert gate.state == GateState.REASONING and fed(gate, [MESSAGE, 10]) == [10]
    # The last complete marker wins: an analysis header after a final one reasons.
    gate = ReasoningGate(HARMONY, [START, CHANNEL, FINAL, MESSAGE, 10, CHANNEL, ANALYSIS,
                                   MESSAGE])
    assert gate.state == GateState.REASONING


def test_undecided_multi_token_start_opens_on_its_first_token():
    """A family that may answer without reasoning, with several-token markers whose first
    token is shared (harmony-like): the start's first token opens the reasoning, and it
    also counts as the beginning of the end marker."""
    markers = GateMarkers(start=(CHANNEL, ANALYSIS, MESSAGE), end=(CHANNEL, FINAL, MESSAGE),
                          starts_in_reasoning=False)
    gate = ReasoningGate(markers, [10])
    assert gate.state == GateState.UNDECIDED and gate.start_id == CHANNEL
    assert fed(gate, [CHANNEL, FINAL, MESSAGE, 12]) == [12]  # straight to the final header
    gate = ReasoningGate(markers, [10])
    assert fed(gate, [CHANNEL, ANALYSIS, MESSAGE, 11, CHANNEL, FINAL, MESSAGE, 12]) == [12]
    gate = ReasoningGate(markers, [10])
    assert fed(gate, [ANALYSIS, CHANNEL, 12]) == [ANALYSIS, CHANNEL, 12]  # plain answer

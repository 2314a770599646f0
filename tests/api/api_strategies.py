"""Hypothesis strategies for OpenAI request bodies: half plausible, half mangled.

`REQUESTS` draws either a body whose every field holds a value a client could
mean (in range, right type: most are served), or one where each field may also be
junk (wrong type, huge integers, NaN, empty lists: most are rejected), or a hostile
one built to exhaust the cluster (huge lists, long strings, JSON nested thousands
deep, many stop strings, any unicode, a request-supplied chat template: each past
one of the gateway's limits, or served within them). `max_tokens` is always small
or junk, so a served request finishes in a few steps on the tiny model. A body is a
dict, or raw JSON bytes when it nests deeper than `json.dumps` can write.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

SOME_JUNK = st.one_of(st.booleans(), st.integers(-(2**70), 2**70),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                      st.lists(st.integers(-5, 5), max_size=3),
                      st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
JUNK = st.one_of(st.none(), SOME_JUNK)
TEXT = st.text(st.characters(codec="utf-8"), max_size=24)
WORDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=24)
VOCAB = 49152
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)

# Field -> values a client could mean (the "good" half); the mangled half adds JUNK
# and out-of-range values.
GOOD = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 60000),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.05, 3),
    "stop": st.one_of(WORDS, st.lists(WORDS, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 3),
    "n": st.integers(1, 3),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-200, 200),
                                  max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "echo": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
    "user": TEXT,
    "model": st.sampled_from(["tiny", "tiny-alias"]),
}
BAD = {
    "temperature": st.just(-1.0), "top_p": st.floats(1.01, 5), "top_k": st.integers(-9, -2),
    "min_p": st.floats(1.01, 3), "seed": st.integers(2**63, 2**70),
    "presence_penalty": st.floats(2.01, 9), "repetition_penalty": st.just(0.0),
    "stop": st.just(""), "stop_token_ids": st.lists(st.integers(-9, -1), min_size=1),
    "min_tokens": st.integers(-3, -1), "n": st.integers(-1, 0),
    "logit_bias": st.just({"x": 1}), "model": st.just("nope"),
}
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
PART = st.one_of(TEXT_PART, st.fixed_dictionaries({
    "type": st.sampled_from(["image_url", "refusal"]), "text": TEXT}))
GOOD_MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool"]),
    "content": st.one_of(TEXT, st.lists(TEXT_PART, min_size=1, max_size=2))})
ANY_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"])},
    optional={"content": st.one_of(TEXT, st.lists(PART, max_size=2), JUNK)})
MAX_TOKENS = st.integers(1, 6)
# Never null: chat would then generate up to the whole context.
BAD_MAX_TOKENS = st.one_of(st.integers(-1, 0), SOME_JUNK)

COMPLETION = ({"prompt": st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=2), TOKEN_IDS,
                                   st.lists(TOKEN_IDS, min_size=1, max_size=2))},
              {"logprobs": st.integers(0, 5), "prompt_logprobs": st.integers(0, 5)},
              {"prompt": st.one_of(TEXT, st.lists(st.integers(-3, 2**40), max_size=3),
                                   st.lists(TOKEN_IDS, max_size=2).map(lambda x: x + [[]]),
                                   JUNK),
               "logprobs": st.integers(-2, 40), "suffix": TEXT,
               "prompt_logprobs": st.integers(-2, 40)})
CHAT = ({"messages": st.lists(GOOD_MESSAGE, min_size=1, max_size=3)},
        {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
         "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
         "chat_template_kwargs": st.dictionaries(st.just("x"), st.integers(), max_size=1)},
        {"messages": st.one_of(st.lists(ANY_MESSAGE, max_size=3), JUNK),
         "top_logprobs": st.integers(-2, 40), "max_completion_tokens": BAD_MAX_TOKENS,
         "chat_template_kwargs": st.dictionaries(st.just("tools"), st.integers(), max_size=1)})


def _good(required: dict, optional: dict) -> st.SearchStrategy:
    optional = {**GOOD, **optional}
    return st.fixed_dictionaries({**required, "max_tokens": MAX_TOKENS}, optional=optional)


def _mangled(required: dict, optional: dict, bad: dict) -> st.SearchStrategy:
    """Each field: good, bad or junk."""
    fields = {**GOOD, **optional, **required}
    mixed = {k: st.one_of(v, BAD.get(k, JUNK), JUNK, bad.get(k, JUNK)) for k, v in fields.items()}
    mixed["max_tokens"] = st.one_of(MAX_TOKENS, BAD_MAX_TOKENS)
    required_keys = [*required, "max_tokens"]
    return st.fixed_dictionaries({k: mixed[k] for k in required_keys},
                                 optional={k: v for k, v in mixed.items()
                                           if k not in required_keys})


def _requests(path: str, spec: tuple) -> st.SearchStrategy:
    required, optional, bad = spec
    return st.tuples(st.just(path), st.one_of(_good(required, optional),
                                              _mangled(required, optional, bad)))


def _nested(depth: int, leaf) -> bytes:
    """JSON text `depth` levels deep (json.dumps would hit Python's recursion limit)."""
    return b'{"a":[' * depth + json.dumps(leaf).encode() + b"]}" * depth


ANY_TEXT = st.text(st.characters(), min_size=1, max_size=64)  # surrogates, RTL, controls
LONG_TEXT = st.integers(20_000, 200_000).map(lambda n: "word " * (n // 5))
HUGE_LIST = st.integers(1025, 3000).map(lambda n: ["x"] * n)  # past --max-prompts-per-request
MANY_IDS = st.integers(2000, 60_000).map(lambda n: [5] * n)
MANY_STOPS = st.integers(65, 400).map(lambda n: [f"s{i}" for i in range(n)])
LONG_STOP = st.integers(1025, 50_000).map(lambda n: "s" * n)
BIG_BIAS = st.integers(1025, 5000).map(lambda n: {str(i): 1.0 for i in range(n)})
REQUEST_TEMPLATE = st.sampled_from(["{{ 7*7 }}", "{% for i in range(10**9) %}{% endfor %}"])
HOSTILE_COMPLETION = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": MAX_TOKENS,
     "prompt": st.one_of(ANY_TEXT, LONG_TEXT, HUGE_LIST, MANY_IDS)},
    optional={"stop": st.one_of(MANY_STOPS, LONG_STOP, st.lists(ANY_TEXT, max_size=3)),
              "stop_token_ids": MANY_IDS, "logit_bias": BIG_BIAS,
              "n": st.integers(129, 10_000), "logprobs": st.integers(21, 10**6)})
HOSTILE_CHAT = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": MAX_TOKENS,
     "messages": st.one_of(
         st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": ANY_TEXT}),
                  min_size=1, max_size=3),
         st.integers(4097, 6000).map(lambda n: [{"role": "user", "content": "x"}] * n),
         LONG_TEXT.map(lambda t: [{"role": "user", "content": t}]))},
    optional={"chat_template_kwargs": st.one_of(
        REQUEST_TEMPLATE.map(lambda t: {"chat_template": t}),
        st.integers(33, 200).map(lambda d: {"x": json.loads(_nested(d, 1))})),
        "chat_template": REQUEST_TEMPLATE, "top_logprobs": st.integers(21, 10**6),
        "logprobs": st.just(True), "stop": st.one_of(MANY_STOPS, LONG_STOP)})
DEEP_BODY = st.tuples(st.sampled_from(["/completions", "/chat/completions"]),
                      st.integers(1000, 50_000)).map(
    lambda p: (p[0], b'{"model":"tiny","max_tokens":2,"prompt":"x","messages":'
                     b'[{"role":"user","content":"x"}],"stop":' + _nested(p[1], "s") + b"}"))
HOSTILE = st.one_of(st.tuples(st.just("/completions"), HOSTILE_COMPLETION),
                    st.tuples(st.just("/chat/completions"), HOSTILE_CHAT), DEEP_BODY)

REQUESTS = st.one_of(_requests("/completions", COMPLETION), _requests("/chat/completions", CHAT),
                     HOSTILE)

"""StopAwareDecoder, the one decoder of the offline and the served path: streamed deltas add
up to the final text, a stop string is cut wherever token boundaries fall, no delta shows
text a stop string later removes, min_tokens delays stop strings, the token that ended the
request follows vLLM's text rule, and the token that completed a match is the same whatever
the batching."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer.detokenizer import IncrementalDetokenizer
from pagoda.tokenizer.stop_aware_decoder import StopAwareDecoder

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TEXT = "The quick brown fox jumps over the lazy dog. Then it stops: END of story, héllo 🦊!"


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer) -> list[int]:
    text = "<|im_start|>user\nAnswer<|im_end|>\n<|im_start|>assistant\n"
    return smollm2_tokenizer.encode(text, add_special_tokens=False)


def run(tok, prompt, ids, sizes=(1,), finish=True, stop_terminated=False, **kwargs):
    """Feed `ids` in batches (sizes cycle through `sizes`) until a step finishes; the last
    batch says `finished` (if `finish`) and `stop_terminated`. Returns the decoder, the
    deltas, the stop string and the number of tokens used."""
    if isinstance(ids, str):
        ids = tok.encode(ids, add_special_tokens=False)
    dec = StopAwareDecoder(tok, prompt, **kwargs)
    deltas, used, stop_str, pos, k = [], 0, None, 0, 0
    while pos < len(ids):
        batch = ids[pos:pos + sizes[k % len(sizes)]]
        pos, k = pos + len(batch), k + 1
        last = pos >= len(ids)
        step = dec.update(batch, finished=finish and last, stop_terminated=stop_terminated and last)
        deltas.append(step.text)
        used += step.num_tokens_used
        assert dec.output_text == "".join(deltas)
        if step.finished:
            stop_str = step.stop_str
            assert dec.finished and dec.stop_reason == stop_str
            break
    return dec, deltas, stop_str, used


def test_stop_string_spanning_token_boundaries(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    text, stop = "The answer is 42. The end of it.", "42. The"
    ids = tok.encode(text, add_special_tokens=False)
    assert all(stop not in tok.decode([i]) for i in ids)  # no single token holds it
    dec, deltas, stop_str, used = run(tok, prompt, ids, stop=[stop])
    assert stop_str == stop and "".join(deltas) == "The answer is "
    assert tok.decode(ids[:used]) == "The answer is 42. The"  # later tokens are dropped
    with pytest.raises(RuntimeError):
        dec.update(ids[-1:])


def test_stop_at_the_very_start(smollm2_tokenizer, prompt):
    dec, deltas, stop_str, used = run(smollm2_tokenizer, prompt, "Hello world", stop=["Hello"])
    assert (stop_str, deltas, dec.output_text, used) == ("Hello", [""], "", 1)


def test_several_stop_strings_earliest_wins(smollm2_tokenizer, prompt):
    for stop in (["gamma", "beta"], ["beta", "gamma"]):
        dec, _, stop_str, _ = run(smollm2_tokenizer, prompt, "alpha beta gamma delta",
                                  sizes=(100,), stop=stop)
        assert (stop_str, dec.output_text) == ("beta", "alpha ")


def test_include_stop_str_in_output(smollm2_tokenizer, prompt):
    dec, _, stop_str, _ = run(smollm2_tokenizer, prompt, "alpha beta gamma", stop=["beta"],
                              include_stop_str_in_output=True)
    assert (stop_str, dec.output_text) == ("beta", "alpha beta")


def test_partial_stop_is_held_until_finished(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    dec, _, stop_str, _ = run(tok, prompt, "the result </ans", finish=False, stop=["</answer>"])
    assert stop_str is None and dec.output_text == "the result " and not dec.finished
    step = dec.update([], finished=True)  # e.g. max_tokens reached
    assert (step.text, step.stop_str, step.num_tokens_used, step.finished) == \
        ("</ans", None, 0, True)
    assert dec.output_text == "the result </ans" and dec.stop_reason is None


def test_text_that_cannot_start_a_stop_string_streams_immediately(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    ids = tok.encode("Plain words, no markers; emoji 😀 and 東京.", add_special_tokens=False)
    dec = StopAwareDecoder(tok, prompt, stop=["###", "</s>"])
    plain = IncrementalDetokenizer(tok, prompt)
    for token_id in ids:
        step = dec.update([token_id])
        assert (step.text, step.stop_str, step.num_tokens_used) == (plain.update([token_id]), None, 1)


@pytest.mark.parametrize("seed", range(3))
def test_without_stop_strings_any_batching_gives_the_one_shot_decode(smollm2_tokenizer, seed):
    ids = smollm2_tokenizer.encode(TEXT, add_special_tokens=False)
    sizes = [random.Random(seed).randint(1, 4) for _ in range(8)]
    dec, _, stop_str, used = run(smollm2_tokenizer, [1, 2, 3], ids, sizes=sizes)
    assert (dec.output_text, stop_str, used) == (smollm2_tokenizer.decode(ids), None, len(ids))


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_tokens_used_end_at_the_token_that_completed_the_match(smollm2_tokenizer, include, seed):
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    sizes = [random.Random(seed).randint(1, 4) for _ in range(8)]
    dec, _, stop_str, used = run(tok, [], ids, sizes=sizes, stop=["END", "zzz"],
                                 include_stop_str_in_output=include)
    assert stop_str == "END" and dec.output_text == TEXT[:TEXT.index("END") + 3 * include]
    assert "END" in tok.decode(ids[:used]) and "END" not in tok.decode(ids[:used - 1])


# ---------------------------------------------------------------- min_tokens
def test_min_tokens_ignores_stop_strings_in_the_first_tokens(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    text = "stop here, then go on and stop again"
    num_first = len(tok.encode("stop here", add_special_tokens=False))
    dec, _, stop_str, _ = run(tok, prompt, text, stop=["stop"], min_tokens=num_first)
    assert (stop_str, dec.output_text) == ("stop", "stop here, then go on and ")
    dec, _, _, _ = run(tok, prompt, text, stop=["stop"])
    assert dec.output_text == ""


@pytest.mark.parametrize("min_tokens, expected", [
    (0, " is L"),
    (5, " is Lee, and I'm a stud"),  # the "e"s of " Lee" are in the first 5 tokens
    (13, " is Lee, and I'm a student in the college of engineering"),  # never checked
])
def test_min_tokens_as_vllm(smollm2_tokenizer, prompt, min_tokens, expected):
    """vLLM's own min_tokens + stop case (tests/detokenizer/test_min_tokens.py)."""
    text = " is Lee, and I'm a student in the college of engineering"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 13 and smollm2_tokenizer.decode(ids[:5]) == " is Lee, and I"
    for sizes in ((1,), (4,), (13,)):
        dec, _, stop_str, _ = run(smollm2_tokenizer, prompt, ids, sizes=sizes, stop=["e"],
                                  min_tokens=min_tokens)
        assert dec.output_text == expected
        assert stop_str == (None if min_tokens == 13 else "e")


def test_stop_string_may_begin_in_the_min_tokens_text(smollm2_tokenizer, prompt):
    """A match counts once it ends in checked text, wherever it begins (vLLM looks back
    `len(stop) - 1` characters before the new text)."""
    tok = smollm2_tokenizer
    ids = tok.encode("The answer is 42. The end of it.", add_special_tokens=False)
    assert tok.decode(ids[:7]) == "The answer is 42." and tok.decode(ids[7:8]) == " The"
    dec, _, stop_str, used = run(tok, prompt, ids, stop=["42. The"], min_tokens=7)
    assert (stop_str, dec.output_text, used) == ("42. The", "The answer is ", 8)
    dec, _, stop_str, used = run(tok, prompt, ids, stop=["42. The"], min_tokens=8)
    assert (stop_str, dec.output_text, used) == (None, tok.decode(ids), len(ids))


# ---------------------------------------------------------------- the token that ended it
@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_shown_only_with_include_stop_str_in_output(smollm2_tokenizer,
                                                                      prompt, include):
    tok = smollm2_tokenizer
    ids = tok.encode("Hello world.", add_special_tokens=False)  # "." is a stop token id
    for sizes in ((1,), (len(ids),)):
        dec, _, stop_str, used = run(tok, prompt, ids, sizes=sizes, stop_terminated=True,
                                     include_stop_str_in_output=include)
        assert (dec.output_text, stop_str, used) == \
            ("Hello world." if include else "Hello world", None, len(ids))
    # Its text is never searched for stop strings: the request ended on the token.
    dec, _, stop_str, _ = run(tok, prompt, ids, stop=["."], stop_terminated=True,
                              include_stop_str_in_output=True)
    assert (dec.output_text, stop_str) == ("Hello world.", None)


def test_eos_text_with_special_tokens_kept(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    ids = tok.encode("Hi<|im_end|>", add_special_tokens=False)
    kept = dict(skip_special_tokens=False, stop_terminated=True)
    assert run(tok, prompt, ids, **kept)[0].output_text == "Hi"
    assert run(tok, prompt, ids, include_stop_str_in_output=True, **kept)[0].output_text == \
        "Hi<|im_end|>"


def test_stop_string_before_the_stop_token_in_one_batch_wins(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    ids = tok.encode("The end.", add_special_tokens=False)
    dec, _, stop_str, used = run(tok, prompt, ids, sizes=(len(ids),), stop=["end"],
                                 stop_terminated=True)
    assert (stop_str, dec.output_text, used) == ("end", "The ", 2)


def test_from_sampling_params(smollm2_tokenizer, prompt):
    params = SamplingParams(stop="beta", include_stop_str_in_output=True, skip_special_tokens=False,
                            min_tokens=1)
    dec = StopAwareDecoder.from_sampling_params(smollm2_tokenizer, prompt, params)
    ids = smollm2_tokenizer.encode("beta<|im_end|>alpha beta", add_special_tokens=False)
    step = dec.update(ids)
    assert (step.text, step.stop_str, step.num_tokens_used) == \
        ("beta<|im_end|>alpha beta", "beta", len(ids))


@SETTINGS
@given(
    data=st.data(),
    words=st.lists(st.sampled_from(["ab", "a", "b", " ", "\n", "abc", "😀", "東", "</", "x"]),
                   max_size=25),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_streaming_never_leaks_a_stop_prefix(
    smollm2_tokenizer, prompt, first_stop_by_chars, data, words, sizes, include
):
    """Random near-miss text, random stop strings (some taken from the text itself), a
    random min_tokens: the streamed deltas add up to the one-shot decode cut at the first
    stop string to complete in checked text."""
    tok = smollm2_tokenizer
    ids = tok.encode("".join(words), add_special_tokens=False)
    decoded = tok.decode(ids)
    stop_piece = st.text(alphabet="ab \n😀東</x", min_size=1, max_size=5)
    if decoded:
        i = data.draw(st.integers(0, len(decoded) - 1), label="i")
        stop_piece = st.one_of(stop_piece, st.just(decoded[i:i + data.draw(st.integers(1, 4), label="n")]))
    stop = data.draw(st.lists(stop_piece, min_size=1, max_size=3), label="stop")
    min_tokens = data.draw(st.integers(0, len(ids) + 1), label="min_tokens")
    dec, deltas, stop_str, _ = run(tok, prompt, ids, sizes=sizes, stop=stop,
                                   include_stop_str_in_output=include, min_tokens=min_tokens)
    # The checked text starts where the text of the first min_tokens tokens ends.
    first = IncrementalDetokenizer(tok, prompt)
    for token_id in ids[:min_tokens]:
        first.update([token_id])
    expected = None if min_tokens >= len(ids) else \
        first_stop_by_chars(decoded, stop, min_end=len(first.output_text))
    if expected is None:
        final = decoded
        assert stop_str is None
    else:
        s, start = expected
        final = decoded[: start + len(s)] if include else decoded[:start]
        assert stop_str == s
    # Deltas cannot be taken back, so any leaked stop prefix would make this fail.
    assert "".join(deltas) == final

"""DetokenizerWithStops: streamed deltas add up to the final text, a stop string is cut
wherever token boundaries fall, and no delta ever shows text a stop string later removes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer.detokenizer import DetokenizerWithStops, IncrementalDetokenizer

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer) -> list[int]:
    text = "<|im_start|>user\nAnswer<|im_end|>\n<|im_start|>assistant\n"
    return smollm2_tokenizer.encode(text, add_special_tokens=False)


def run(tok, prompt, text, chunk=1, finish=True, **kwargs):
    """Stream `text`'s tokens `chunk` at a time until a stop string matches (or, with
    `finish`, the tokens run out and the last update says finished). Returns the
    detokenizer, the deltas and the stop string."""
    ids = tok.encode(text, add_special_tokens=False)
    det = DetokenizerWithStops(tok, prompt, **kwargs)
    deltas, stop_str = [], None
    for pos in range(0, len(ids), chunk):
        last = pos + chunk >= len(ids)
        delta, stop_str = det.update(ids[pos:pos + chunk], finished=finish and last)
        deltas.append(delta)
        assert det.output_text == "".join(deltas)
        if stop_str is not None:
            break
    return det, deltas, stop_str


def test_stop_string_spanning_token_boundaries(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    text, stop = "The answer is 42. The end of it.", "42. The"
    ids = tok.encode(text, add_special_tokens=False)
    assert all(stop not in tok.decode([i]) for i in ids)  # no single token holds it
    det, deltas, stop_str = run(tok, prompt, text, stop=[stop])
    assert stop_str == stop and det.stop_reason == stop and det.finished
    assert "".join(deltas) == "The answer is "
    with pytest.raises(RuntimeError):
        det.update(ids[-1:])


def test_stop_at_the_very_start(smollm2_tokenizer, prompt):
    det, deltas, stop_str = run(smollm2_tokenizer, prompt, "Hello world", stop=["Hello"])
    assert stop_str == "Hello" and deltas == [""] and det.output_text == ""


def test_several_stop_strings_earliest_wins(smollm2_tokenizer, prompt):
    text = "alpha beta gamma delta"
    for stop in (["gamma", "beta"], ["beta", "gamma"]):
        det, _, stop_str = run(smollm2_tokenizer, prompt, text, chunk=100, stop=stop)
        assert (stop_str, det.output_text) == ("beta", "alpha ")


def test_include_stop_str_in_output(smollm2_tokenizer, prompt):
    det, _, stop_str = run(smollm2_tokenizer, prompt, "alpha beta gamma", stop=["beta"],
                           include_stop_str_in_output=True)
    assert (stop_str, det.output_text) == ("beta", "alpha beta")


def test_partial_stop_is_held_until_finished(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    det, deltas, stop_str = run(tok, prompt, "the result </ans", finish=False, stop=["</answer>"])
    assert stop_str is None and det.output_text == "the result "
    delta, stop_str = det.update([], finished=True)  # e.g. max_tokens reached
    assert (delta, stop_str) == ("</ans", None)
    assert det.output_text == "the result </ans" and det.finished and det.stop_reason is None


def test_text_that_cannot_start_a_stop_string_streams_immediately(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    text = "Plain words, no markers; emoji 😀 and 東京."
    ids = tok.encode(text, add_special_tokens=False)
    det = DetokenizerWithStops(tok, prompt, stop=["###", "</s>"])
    plain = IncrementalDetokenizer(tok, prompt)
    for token_id in ids:
        assert det.update([token_id]) == (plain.update([token_id]), None)


def test_min_tokens_ignores_stop_strings_in_the_first_tokens(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    text = "stop here, then go on and stop again"
    num_first = len(tok.encode("stop here", add_special_tokens=False))
    det, _, stop_str = run(tok, prompt, text, stop=["stop"], min_tokens=num_first)
    assert (stop_str, det.output_text) == ("stop", "stop here, then go on and ")
    det, _, _ = run(tok, prompt, text, stop=["stop"])
    assert det.output_text == ""


def test_from_sampling_params(smollm2_tokenizer, prompt):
    params = SamplingParams(stop="beta", include_stop_str_in_output=True, skip_special_tokens=False)
    det = DetokenizerWithStops.from_sampling_params(smollm2_tokenizer, prompt, params)
    ids = smollm2_tokenizer.encode("<|im_end|>alpha beta", add_special_tokens=False)
    assert det.update(ids) == ("<|im_end|>alpha beta", "beta")


@SETTINGS
@given(
    data=st.data(),
    words=st.lists(st.sampled_from(["ab", "a", "b", " ", "\n", "abc", "😀", "東", "</", "x"]),
               max_size=25),
    chunk=st.integers(1, 3),
    include=st.booleans(),
)
def test_streaming_never_leaks_a_stop_prefix(
    smollm2_tokenizer, prompt, first_stop_by_chars, data, words, chunk, include
):
    """Random near-miss text, random stop strings (some taken from the text itself): the
    streamed deltas add up to the one-shot decode cut at the first stop string to
    complete."""
    tok = smollm2_tokenizer
    text = "".join(words)
    decoded = tok.decode(tok.encode(text, add_special_tokens=False))
    stop_piece = st.text(alphabet="ab \n😀東</x", min_size=1, max_size=5)
    if decoded:
        i = data.draw(st.integers(0, len(decoded) - 1), label="i")
        stop_piece = st.one_of(stop_piece, st.just(decoded[i:i + data.draw(st.integers(1, 4), label="n")]))
    stop = data.draw(st.lists(stop_piece, min_size=1, max_size=3), label="stop")
    det, deltas, stop_str = run(tok, prompt, text, chunk=chunk, stop=stop, include_stop_str_in_output=include)
    expected = first_stop_by_chars(decoded, stop)
    if expected is None:
        final = decoded
        assert stop_str is None
    else:
        s, start = expected
        final = decoded[: start + len(s)] if include else decoded[:start]
        assert stop_str == s
    # Deltas cannot be taken back, so any leaked stop prefix would make this fail.
    assert "".join(deltas) == final

"""IncrementalDetokenizer: streamed deltas add up to a one-shot decode, never show half a
character, and cost O(1) per token."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.tokenizer.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
REAL_TEXTS = [
    "Hello, world! 👋 How are you?",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Family: 👨‍👩‍👧‍👦, flags: 🇫🇷🇯🇵, skin tone: 👍🏽, keycap: 1️⃣",
    "  leading spaces, \ttabs\tand\n\nnewlines   \n trailing  ",
    "café naïve coöperate e\u0301 ﬁ Ω≈ç√∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🎉🎉🎉",
    "def f(x):\n    return x ** 2  # ½ → ¼\n",
]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int] | None = None) -> list[str]:
    """Feed `ids` in chunks (sizes cycle through `chunk_sizes`, default 1); return the
    deltas, the flush included."""
    sizes = chunk_sizes or [1]
    deltas, pos, k = [], 0, 0
    while pos < len(ids):
        size = sizes[k % len(sizes)]
        deltas.append(detok.update(ids[pos:pos + size]))
        pos, k = pos + size, k + 1
    deltas.append(detok.flush())
    return deltas


def chat_prompt(tok) -> list[int]:
    text = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def partial_char_ids(smollm2_tokenizer) -> list[int]:
    """Vocabulary entries that are not whole UTF-8 (they decode to U+FFFD on their own)."""
    tok = smollm2_tokenizer
    return [i for i in range(len(tok)) if REPLACEMENT in tok.decode([i])]


@SETTINGS
@given(data=st.data(), skip_special_tokens=st.booleans(),
       chunk_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_random_token_ids_concatenate_to_one_shot_decode(
    smollm2_tokenizer, partial_char_ids, data, skip_special_tokens, chunk_sizes
):
    tok = smollm2_tokenizer
    token = st.one_of(
        st.integers(0, len(tok) - 1),
        st.integers(0, 16),  # SmolLM2's special tokens
        st.sampled_from(partial_char_ids),
    )
    ids = data.draw(st.lists(token, max_size=40), label="ids")
    prompt = data.draw(st.sampled_from([[], chat_prompt(tok), tok.encode("The weather today")]), label="prompt")
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids, chunk_sizes)
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    assert detok.output_text == expected
    assert detok.token_ids == ids


def check_real_text(tok, text: str, prompt: list[int]) -> None:
    """Per token: nothing emitted is ever a replacement char, and as soon as the decoded
    prefix is whole characters, all of it has been emitted."""
    ids = tok.encode(text, add_special_tokens=False)
    # A character the vocabulary cannot spell (SmolLM2's GGUF vocabulary lacks some lead
    # bytes) decodes to U+FFFD even in one shot; only then may a delta contain one.
    whole_is_clean = REPLACEMENT not in tok.decode(ids)
    detok = IncrementalDetokenizer(tok, prompt)
    for i, token_id in enumerate(ids):
        delta = detok.update([token_id])
        assert whole_is_clean is False or REPLACEMENT not in delta
        so_far = tok.decode(ids[: i + 1])
        if not so_far.endswith(REPLACEMENT):
            assert detok.output_text == so_far, f"after token {i}"
    flushed = detok.flush()
    assert flushed == "" or not whole_is_clean
    assert detok.output_text == tok.decode(ids)


@pytest.mark.parametrize("text", REAL_TEXTS)
def test_real_text_emits_each_character_once_it_is_complete(smollm2_tokenizer, text):
    check_real_text(smollm2_tokenizer, text, chat_prompt(smollm2_tokenizer))


@SETTINGS
@given(text=st.text(min_size=1, max_size=60))
def test_random_unicode_text_never_shows_partial_characters(smollm2_tokenizer, text):
    check_real_text(smollm2_tokenizer, text, [])


def test_real_texts_round_trip_through_the_tokenizer(smollm2_tokenizer):
    # Guards the test above: on these texts the "no U+FFFD" checks really apply.
    tok = smollm2_tokenizer
    for text in REAL_TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_emoji_split_across_tokens_is_held_then_emitted_whole(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("ok 😀", add_special_tokens=False)
    # Precondition: the emoji's bytes span two tokens, the first of which is incomplete.
    assert tok.decode(ids[:-1]).endswith(REPLACEMENT)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.update([token_id]) for token_id in ids]
    assert "".join(deltas[:-2]) == "ok"
    assert deltas[-2] == ""  # the space and the emoji's first bytes are held together
    assert deltas[-1] == " 😀"


def test_trailing_partial_character_is_flushed_as_replacement(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("ok 😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.update([token_id]) for token_id in ids) == "ok"
    assert detok.flush() == tok.decode(ids)[len("ok"):]
    assert detok.flush() == ""  # idempotent
    assert detok.output_text == tok.decode(ids)
    with pytest.raises(RuntimeError):
        detok.update(ids)


def test_skip_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hi there<|im_end|>", add_special_tokens=False)
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    skipped = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(stream(skipped, ids)) == "Hi there"
    assert "".join(stream(kept, ids)) == "Hi there<|im_end|>"
    assert skipped.token_ids == ids


class _DecodeRecorder:
    """Wraps a tokenizer and records how many ids each backend decode call gets."""

    def __init__(self, tok):
        self._tok = tok
        self.window_sizes: list[int] = []
        recorder = self

        class Backend:
            def decode(self, ids, skip_special_tokens):
                recorder.window_sizes.append(len(ids))
                return tok.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

            def get_added_tokens_decoder(self):
                return tok.backend_tokenizer.get_added_tokens_decoder()

        self.backend_tokenizer = Backend()


def test_cost_per_token_does_not_grow_with_the_output(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(" ".join(REAL_TEXTS) * 40, add_special_tokens=False)
    assert len(ids) > 2000
    recorder = _DecodeRecorder(tok)
    detok = IncrementalDetokenizer(recorder, chat_prompt(tok))
    stream(detok, ids)
    assert detok.output_text == tok.decode(ids)
    # Each decode sees the emitted context chunk plus the pending tokens, never the output.
    assert max(recorder.window_sizes) <= 8
    assert len(recorder.window_sizes) <= 2 * len(ids) + 2


# ---------------------------------------------------------------- SentencePiece decoders
def sp_expected(tok, prompt: list[int], ids: list[int]) -> str:
    whole, prompt_text = tok.decode(prompt + ids), tok.decode(prompt)
    assert whole.startswith(prompt_text)
    return whole[len(prompt_text):]


def test_sentencepiece_first_token_keeps_its_leading_space(sp_tokenizer):
    tok = sp_tokenizer
    prompt = tok.encode("Hello")
    ids = tok.convert_tokens_to_ids(["▁world"])  # what a model continuing "Hello" emits
    assert tok.decode(ids) == "world"  # decoded alone, the Strip decoder eats the space
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.update(ids) == " world"
    # Without a prompt there is nothing to strip against: same as a one-shot decode.
    assert "".join(stream(IncrementalDetokenizer(tok, []), ids)) == "world"


@pytest.mark.parametrize("text", REAL_TEXTS + ["Hello world the end", " a  b   c "])
@pytest.mark.parametrize("prompt_text", [None, "Hello", "the stop!"])
def test_sentencepiece_byte_fallback_matches_whole_sequence_decode(sp_tokenizer, text, prompt_text):
    tok = sp_tokenizer
    prompt = [] if prompt_text is None else tok.encode(prompt_text)
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == sp_expected(tok, prompt, ids)

"""The native (Rust DecodeStream) incremental detokenizer against the Python window it
replaces: for random token sequences, any chunking and either skip_special_tokens, every
delta and the flush are the same strings, so a client sees byte-identical text. Byte-level
BPE (SmolLM2, rebuilt from its GGUF) and SentencePiece decoders (Replace/ByteFallback/Fuse/
Strip, and Metaspace), byte-fallback tokens and invalid byte runs included."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders
from transformers import PreTrainedTokenizerFast

from pagoda.tokenizer.decode_plan import decode_plan
from pagoda.tokenizer.detokenizer import IncrementalDetokenizer

from test_detokenizer import stream as deltas  # the same chunked feeding

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def metaspace_tokenizer(sp_tokenizer):
    """The tiny SentencePiece vocabulary with a Metaspace decoder (newer Llama/Mistral
    files) instead of Replace/ByteFallback/Fuse/Strip."""
    backend = sp_tokenizer.backend_tokenizer.__class__.from_str(
        sp_tokenizer.backend_tokenizer.to_str())
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module", params=["smollm2", "sp", "metaspace"])
def tok(request, smollm2_tokenizer, sp_tokenizer, metaspace_tokenizer):
    return {"smollm2": smollm2_tokenizer, "sp": sp_tokenizer,
            "metaspace": metaspace_tokenizer}[request.param]


def test_the_native_stream_serves_these_tokenizers(tok):
    assert decode_plan(tok).native


_strategies: dict[int, st.SearchStrategy] = {}


def _token_strategy(tok):
    """Any id, special ids, and ids that are not whole UTF-8 on their own."""
    if id(tok) not in _strategies:
        _strategies[id(tok)] = _make_token_strategy(tok)
    return _strategies[id(tok)]


def _make_token_strategy(tok):
    plan = decode_plan(tok)
    specials = sorted(plan.skipped_ids) or [0]
    partial = [i for i in range(min(len(tok), 20000)) if "\ufffd" in tok.decode([i])][:300]
    parts = [st.integers(0, len(tok) - 1), st.sampled_from(specials)]
    if partial:
        parts.append(st.sampled_from(partial))
    return st.one_of(*parts)


@SETTINGS
@given(data=st.data(), skip_special_tokens=st.booleans(),
       sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_native_deltas_equal_the_python_window(tok, data, skip_special_tokens, sizes):
    ids = data.draw(st.lists(_token_strategy(tok), max_size=40), label="ids")
    prompt = data.draw(st.lists(_token_strategy(tok), max_size=8), label="prompt")
    native = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    python = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens,
                                    native=False)
    assert deltas(native, ids, sizes) == deltas(python, ids, sizes)
    assert native.output_text == python.output_text
    assert native.token_ids == python.token_ids == ids


def test_real_text_stays_on_the_native_stream(smollm2_tokenizer):
    """Text without byte tokens never leaves the stream (else the speed-up is lost)."""
    tok = smollm2_tokenizer
    ids = tok.encode("Hello, world! 👋 東京 café", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    text = "".join(detok.update([i]) for i in ids)
    assert detok._stream is not None
    assert text + detok.flush() == tok.decode(ids)


def test_a_byte_token_moves_the_request_to_the_python_window(sp_tokenizer):
    tok = sp_tokenizer
    ids = tok.encode("Hello 東京 world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    text = "".join(detok.update([i]) for i in ids) + detok.flush()
    assert detok._stream is None
    python = IncrementalDetokenizer(tok, tok.encode("Hello"), native=False)
    assert text == "".join(python.update([i]) for i in ids) + python.flush()

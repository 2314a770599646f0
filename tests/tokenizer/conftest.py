"""Fixtures for the tokenizer tests. SmolLM2's real tokenizer (byte-level BPE, rebuilt
from the GGUF once per session) is `smollm2_tokenizer` from tests/conftest.py; here: a tiny
Llama-2-style SentencePiece tokenizer (Metaspace + byte fallback) built in memory, and a
reference stop-string search."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
from transformers import PreTrainedTokenizerFast

# Words of the tiny SentencePiece vocabulary; every other character falls back to bytes.
SP_WORDS = ["▁", "▁Hello", "▁world", "Hello", "▁the", "▁stop", "▁end", "▁a", "a", "b", "c",
            "d", "e", "l", "o", "r", "s", "t", ".", ",", "!"]
SP_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[tools: {{ tools | length }}]{% endif %}"
    "{% if greeting %}{{ greeting }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="session")
def sp_tokenizer():
    """A Llama-2-like tokenizer: '▁' marks spaces, the decoder strips one leading space,
    unknown characters become <0xNN> byte tokens, and encode() adds a BOS."""
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{i:02X}>", 0.0) for i in range(256)]
    pieces += [(word, -float(rank + 1)) for rank, word in enumerate(SP_WORDS)]
    tk = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tk.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = SP_CHAT_TEMPLATE
    return tok


def _first_stop_by_chars(text: str, stop: list[str], min_end: int = 0) -> tuple[str, int] | None:
    """Reference stop search: scan one character at a time; return (stop_str, match start)
    for the first stop string to complete (the longest one on a tie), or None. Only matches
    ending after `min_end` characters count (the text of the first min_tokens tokens)."""
    for end in range(min_end + 1, len(text) + 1):
        done = [s for s in stop if text[:end].endswith(s)]
        if done:
            s = max(done, key=len)
            return s, end - len(s)
    return None


@pytest.fixture(scope="session")
def first_stop_by_chars():
    return _first_stop_by_chars

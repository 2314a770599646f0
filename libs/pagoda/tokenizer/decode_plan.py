"""What a tokenizer's decoder allows the incremental detokenizer: facts computed once per
tokenizer (not per request) and cached for the tokenizer's lifetime.

`native`: the Rust `tokenizers.decoders.DecodeStream` may stream this tokenizer's output.
That stream runs the same prefix/read-offset algorithm as the Python window in
detokenizer.py, but it compares the new window's text with the context's text by byte
length and refuses (InvalidPrefix) when the window's text does not start with the
context's: the two agree exactly whenever decoding more tokens never changes text
already decoded. That holds for the decoders listed in `_PREFIX_STABLE` (each maps tokens
to text on their own, or joins bytes left to right, or strips at the window's start, which
both paths decode alike), except for one case: SentencePiece's `ByteFallback` judges a
run of byte tokens as a whole, so an invalid byte can turn an already complete character
into U+FFFDs. So a tokenizer whose decoder has `ByteFallback` lists its byte tokens
(`byte_ids`); a request leaves the native stream for the Python window on its first one.
Any decoder not listed (WordPiece, CTC, BPE suffixes, ...) takes the Python window.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass
from typing import Any

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the Python window only
    DecodeStream = None

# Decoder types whose output for a window never changes text already decoded (see above).
_PREFIX_STABLE = {"ByteLevel", "Replace", "Fuse", "Strip", "Metaspace", "ByteFallback"}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True)
class DecodePlan:
    # The ids a decode with skip_special_tokens=True drops.
    skipped_ids: frozenset[int]
    # The Rust DecodeStream may be used (see the module docstring).
    native: bool
    # Byte-fallback tokens (<0xNN>): a request leaves the native stream on the first one.
    byte_ids: frozenset[int]


_plans: "weakref.WeakKeyDictionary[Any, DecodePlan]" = weakref.WeakKeyDictionary()


def decode_plan(tokenizer: Any) -> DecodePlan:
    """The tokenizer's DecodePlan (computed on first use, then cached)."""
    try:
        return _plans[tokenizer]
    except (KeyError, TypeError):
        pass
    plan = _compute(tokenizer)
    try:
        _plans[tokenizer] = plan
    except TypeError:  # not weak-referenceable: computed per call
        pass
    return plan


def _compute(tokenizer: Any) -> DecodePlan:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return DecodePlan(frozenset(tokenizer.all_special_ids), False, frozenset())
    # For Rust-backed tokenizers the skipped ids are the added tokens marked `special`
    # (a superset of `all_special_ids`).
    added = backend.get_added_tokens_decoder()
    skipped = frozenset(i for i, token in added.items() if token.special)
    types = _decoder_types(backend)
    native = DecodeStream is not None and types is not None and types <= _PREFIX_STABLE
    byte_ids: frozenset[int] = frozenset()
    if native and "ByteFallback" in types:
        byte_ids = frozenset(i for t, i in backend.get_vocab(with_added_tokens=False).items()
                             if _BYTE_TOKEN.fullmatch(t))
    return DecodePlan(skipped, native, byte_ids)


def _decoder_types(backend: Any) -> set[str] | None:
    """The decoder's component types (a Sequence's members); None when there is no
    decoder or it cannot be read."""
    decoder = getattr(backend, "decoder", None)  # a stand-in backend may have none
    if decoder is None:
        return None
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 - unknown decoder shape: not native
        return None
    parts = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
    types = {part.get("type") for part in parts}
    return types if types and None not in types else None

"""A digest of what a tokenizer's decode depends on, to tell two loads of "the same
path" apart when they are not the same tokenizer.

Two processes may read one path and get different files (pods with their own copy of
a model volume, a model updated in place between two starts). A gateway that decodes
with its own load of the tokenizer service's path (services/gateway/generation/
local_decode.py) must produce the service's text; where the two loads differ it must
not decode at all. Equal vocabulary sizes do not show that (a retrained merges table
keeps the size); this digest covers the vocabulary, the added and special tokens,
the whole fast-tokenizer pipeline (normaliser, pre-tokeniser, model, decoder) when
there is one, and the decode-time settings.

Invariant: a pure function of the tokenizer's decode-relevant state: two loads of the
same files give the same digest in any process; a change to any token's id or
string, any added or special token, the decoder, or `clean_up_tokenization_spaces`
gives another.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hex sha256 of the tokenizer's decode-relevant state (see the module docstring)."""
    digest = hashlib.sha256()
    digest.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The fast tokenizer's whole pipeline, as its own JSON (vocabulary and merges
        # included): the decoder and the added tokens' flags decide the text.
        digest.update(backend.to_str().encode())
    else:
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        digest.update(json.dumps(vocab, ensure_ascii=False).encode())
    settings = {
        "special": list(getattr(tokenizer, "all_special_tokens", [])),
        "added": sorted((getattr(tokenizer, "get_added_vocab", dict)()).items()),
        "clean_up_tokenization_spaces": getattr(tokenizer, "clean_up_tokenization_spaces", None),
        "size": len(tokenizer),
    }
    digest.update(json.dumps(settings, ensure_ascii=False, default=str).encode())
    return digest.hexdigest()

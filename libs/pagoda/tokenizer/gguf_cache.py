"""A GGUF file's tokenizer, converted once per machine.

transformers rebuilds a tokenizer from GGUF metadata in seconds of CPU (~8 s for
SmolLM2's 49k-token BPE here), and every process of a cluster that needs the
tokenizer (each tokenizer replica, the scheduler's grammar backend) paid it at every
start. The converted tokenizer is saved once, with `save_pretrained`, under
`<cache root>/tokenizers/<key>` and read back from its tokenizer.json (~0.3 s).

Invariants:
- the key covers the file (real path, size, mtime) and the transformers and tokenizers
  versions that converted it: a changed file or library converts again;
- a cache entry appears whole or not at all (written to a temporary directory, then
  renamed into place), so a reader never sees half of one; two processes converting at
  once both succeed, and the first rename wins;
- any failure to read or write the cache falls back to the conversion, logged: the
  cache can make a start faster, never wrong or failed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import tokenizers
import transformers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagoda.kernels.cache_dir import cache_root

logger = logging.getLogger(__name__)
# Written last into an entry: an entry without it is not one (a copy from elsewhere).
_COMPLETE = "pagoda-converted-from-gguf"
# The classes an entry's tokenizer_config.json may name that `PreTrainedTokenizerFast`
# is (transformers 5 calls it TokenizersBackend): such an entry is read with it
# directly. AutoTokenizer would pick the same class with the same arguments, after
# importing transformers' model registry and torch (~1.5 s of CPU per process, in
# each tokenizer replica at a cluster's start).
_FAST_CLASS_NAMES = {"PreTrainedTokenizerFast", PreTrainedTokenizerFast.__name__}


def entry_dir(gguf_path: str) -> Path:
    """Where `gguf_path`'s converted tokenizer is (or would be) kept."""
    real = os.path.realpath(gguf_path)
    stat = os.stat(real)
    key = "\0".join([real, str(stat.st_size), str(stat.st_mtime_ns), transformers.__version__,
                     tokenizers.__version__])
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def load_gguf_tokenizer(gguf_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF file: from the cache if an entry is there, else converted
    (and the conversion saved for the next process)."""
    try:
        entry = entry_dir(gguf_path)
        if (entry / _COMPLETE).exists():
            return _read_entry(entry)
    except Exception as exc:  # noqa: BLE001 - a bad entry costs the conversion, no more
        logger.warning("the cached tokenizer of %s could not be read (%s); converting it "
                       "again", gguf_path, exc)
        entry = None
    from transformers import AutoTokenizer  # lazy: see _FAST_CLASS_NAMES

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                              gguf_file=os.path.basename(gguf_path))
    if entry is not None:
        _store(tokenizer, entry)
    return tokenizer


def _read_entry(entry: Path) -> PreTrainedTokenizerBase:
    """A stored conversion: with the fast class itself when the entry names it, else
    (another class) through AutoTokenizer."""
    with open(entry / "tokenizer_config.json", encoding="utf-8") as f:
        class_name = json.load(f).get("tokenizer_class")
    if class_name in _FAST_CLASS_NAMES:
        return PreTrainedTokenizerFast.from_pretrained(str(entry))
    from transformers import AutoTokenizer  # lazy: see _FAST_CLASS_NAMES

    return AutoTokenizer.from_pretrained(str(entry))


def _store(tokenizer: PreTrainedTokenizerBase, entry: Path) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=entry.parent))
        try:
            tokenizer.save_pretrained(str(staging))
            (staging / _COMPLETE).write_text("converted by pagoda.tokenizer.gguf_cache\n")
            os.rename(staging, entry)
        except OSError:
            if not (entry / _COMPLETE).exists():
                raise
            # Another process stored the same conversion first: theirs stands.
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except Exception as exc:  # noqa: BLE001 - the conversion is still good to use
        logger.warning("could not cache the converted tokenizer under %s: %s", entry, exc)

"""Load the HF tokenizer (with its chat template) of a model directory or GGUF file."""

from __future__ import annotations

import functools
import glob
import os
from typing import TYPE_CHECKING

from pagoda.model.hub import download, is_hub_id
from pagoda.model.model_path import default_model_path
from pagoda.tokenizer.gguf_cache import load_gguf_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_tokenizer_path(source: str | None, revision: str | None = None,
                           download_dir: str | None = None) -> str:
    """A tokenizer directory, a .gguf file, a directory with exactly one .gguf, or a
    Hugging Face id (its tokenizer files fetched at `revision`, `pagoda.model.hub`) -> path.

    None means the default model. Directories with tokenizer files win over GGUFs.
    """
    if source is None:
        return default_model_path()
    if is_hub_id(source):
        return download(source, revision, download_dir, kind="tokenizer")
    path = os.path.abspath(os.path.expanduser(source))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
            return path
        ggufs = glob.glob(os.path.join(path, "*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    if not os.path.exists(path):
        raise FileNotFoundError(f"Tokenizer path {source!r} does not exist")
    raise ValueError(f"No tokenizer in {source!r}: expected a directory with tokenizer.json "
                     "or tokenizer_config.json, or a single .gguf file")


@functools.lru_cache(maxsize=8)
def _load(path: str) -> PreTrainedTokenizerBase:
    if path.endswith(".gguf"):
        # Rebuilding a tokenizer from GGUF metadata takes seconds: converted once per
        # machine (gguf_cache.py), and once per process here.
        return load_gguf_tokenizer(path)
    # lazy: AutoTokenizer imports transformers' model registry and, through it, torch
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_tokenizer(model_path: str | None, tokenizer: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of `tokenizer` if given, else of `model_path` (a dir or GGUF file).

    Cached per path for the life of the process: callers share one instance and
    must not change its settings (padding, truncation, special tokens).
    """
    return _load(resolve_tokenizer_path(tokenizer or model_path))

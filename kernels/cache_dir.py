"""Where Pagoda keeps what it builds or converts once per machine (the CPU kernels,
converted tokenizers): $PAGODA_CACHE_DIR, else $XDG_CACHE_HOME/pagoda, else
~/.cache/pagoda. Imports nothing but the standard library, so a tokenizer-only
process can ask without loading torch."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("PAGODA_CACHE_DIR"):
        return Path(os.environ["PAGODA_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "pagoda"

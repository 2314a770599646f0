"""Paths of the checked-in test fixtures. A plain module, imported by name: test modules
cannot import the root conftest (`from conftest import` finds whichever conftest pytest
imported first, tests/tokenizer's in a full run)."""

from __future__ import annotations

import pathlib

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TINY_LLAMA_CONFIG = FIXTURES / "tiny_llama" / "config.json"

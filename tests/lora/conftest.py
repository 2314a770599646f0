"""Random PEFT adapters on the tiny Llama (tests/conftest.py `tiny_llama_dir`)."""

from __future__ import annotations

import pytest
from lora_fixtures import make_adapter


@pytest.fixture(scope="session")
def adapters(tiny_llama_dir, tmp_path_factory) -> list[str]:
    """Three adapters: two on every projection (ranks 8 and 4), one on attention only."""
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(tiny_llama_dir, str(root / "a1"), seed=1, rank=8),
            make_adapter(tiny_llama_dir, str(root / "a2"), seed=2, rank=4),
            make_adapter(tiny_llama_dir, str(root / "a3"), seed=3, rank=8,
                         targets=["q_proj", "v_proj"])]

"""Fixtures for structured outputs: managers on SmolLM2's vocabulary, and (from
structured_output_cases) the tiny reasoning-vocabulary model."""

from __future__ import annotations

import pytest
from structured_output_cases import think_model_dir, think_tokenizer  # noqa: F401 (fixtures)

from pagoda.config import StructuredOutputsConfig
from pagoda.structured_output.manager import StructuredOutputManager

EOS = 2


@pytest.fixture(scope="session")
def make_manager(smollm2_tokenizer):
    """StructuredOutputManager(config=..., tokenizer=SmolLM2's by default)."""
    managers = []

    def make(config: StructuredOutputsConfig | None = None, tokenizer=None,
             vocab_size: int = 49152) -> StructuredOutputManager:
        tok = tokenizer or smollm2_tokenizer
        manager = StructuredOutputManager(config or StructuredOutputsConfig(), vocab_size,
                                          lambda: tok, [EOS])
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.shutdown()

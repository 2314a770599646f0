"""Shared helpers for the sampler tests: build a step's metadata in one call."""

from __future__ import annotations

import pytest
import torch

from pagoda.sample.builder import build_sampling_metadata
from pagoda.sample.metadata import SamplingMetadata
from pagoda.sampling_params import SamplingParams


def _build(params: list[SamplingParams], vocab_size: int, *,
           prompts: list[list[int]] | None = None,
           outputs: list[list[int]] | None = None,
           generators: dict[int, torch.Generator] | None = None,
           eos: list[int] | None = None) -> SamplingMetadata:
    num_rows = len(params)
    return build_sampling_metadata(
        params,
        prompts if prompts is not None else [[] for _ in range(num_rows)],
        outputs if outputs is not None else [[] for _ in range(num_rows)],
        generators or {},
        vocab_size,
        [list(eos or []) for _ in range(num_rows)],
    )


@pytest.fixture
def build():
    """`build(params, vocab_size, prompts=, outputs=, generators=, eos=)` -> metadata."""
    return _build

"""Kernel tests: Triton kernels against their torch references.

Without a GPU the kernels run on CPU tensors through the Triton interpreter, which
triton enables for every kernel decorated while `TRITON_INTERPRET=1` is set. Our
kernel modules are imported only by these tests (and by `pagoda.model.ops` for CUDA
tensors), so setting it here, at collection time, is early enough and leaves every
other test alone. With a GPU the same tests run the compiled kernels on CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from pagoda.kernels.testing import patch_triton_interpreter

    patch_triton_interpreter()

_HERE = Path(__file__).parent


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if not HAS_CUDA and "cuda" in item.keywords and _HERE in Path(item.path).parents:
            item.add_marker(skip)

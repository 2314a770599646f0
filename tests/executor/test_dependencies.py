"""The executor package's dependencies point one way (README.md): callers -> factory
-> concrete executors -> base, and `pagoda.distributed` knows no executor. Checked
over the same import graph as tests/test_import_rules.py, lazy imports included."""

from __future__ import annotations

from test_import_rules import MODULES


def imports_of(prefix: str) -> dict[str, set[str]]:
    return {m.name: {i for i in m.all_imports if i in MODULES}
            for m in MODULES.values() if m.name == prefix or m.name.startswith(prefix + ".")}


def test_no_executor_imports_the_factory():
    importers = {name for name, imports in imports_of("pagoda").items()
                 if "pagoda.executor.factory" in imports}
    assert "pagoda.services.gpu_worker.server" in importers  # the graph sees callers
    assert not {n for n in importers if n.startswith(("pagoda.executor", "pagoda.distributed"))}


def test_base_imports_no_executor():
    base = imports_of("pagoda.executor.base")["pagoda.executor.base"]
    assert not {i for i in base if i.startswith("pagoda.executor")}


def test_distributed_imports_no_executor():
    offences = sorted(f"{name} imports {i}" for name, imports in imports_of("pagoda.distributed")
                      .items() for i in imports if i.startswith("pagoda.executor"))
    assert not offences, offences

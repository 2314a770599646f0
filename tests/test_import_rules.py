"""The boundaries ../shared/ARCHITECTURE.md states, checked over the real import graph.

* The engine library (`libs/pagoda`) imports no service code and none of the service
  stack's packages (gRPC, protobuf, FastAPI, uvicorn, Redis), not even lazily.
* The gateway imports no model, worker, sampler or kernel code, directly or through
  what it imports at module level; it may share the plain message types of
  `pagoda.messages`.
* No import cycle among first-party modules (lazy imports inside functions count: a
  cycle hidden in a function body still ties the modules together).

The graph is built from the source with `ast`, so the test needs no import of torch
and runs in well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Package name -> folder, as setup.py maps them.
ROOTS = {"pagoda.services": ROOT / "services", "pagoda.kernels": ROOT / "kernels",
         "pagoda": ROOT / "libs" / "pagoda"}
LIBRARY_FORBIDDEN = ("pagoda.services", "grpc", "google.protobuf", "fastapi", "uvicorn",
                     "starlette", "redis")
GATEWAY_FORBIDDEN = ("pagoda.model", "pagoda.worker", "pagoda.sample", "pagoda.kernels",
                     "pagoda.distributed", "pagoda.executor", "pagoda.engine", "torch")


class Module:
    """One first-party module: its name, file, and the modules its imports name.

    `eager` holds imports that run when the module is imported (module level, not under
    `if TYPE_CHECKING:`); `lazy` those inside function bodies."""

    def __init__(self, name: str, path: Path, is_package: bool):
        self.name, self.path, self.is_package = name, path, is_package
        self.eager: set[str] = set()
        self.lazy: set[str] = set()

    @property
    def all_imports(self) -> set[str]:
        return self.eager | self.lazy


def discover() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package, folder in ROOTS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = list(rel.parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            if "_proto" in parts:
                continue  # generated stubs
            name = ".".join([package, *parts])
            if name in modules:
                continue  # pagoda.services/* seen under its own root first
            modules[name] = Module(name, path, is_package)
    for module in modules.values():
        _collect_imports(module, modules)
    return modules


def _collect_imports(module: Module, modules: dict[str, Module]) -> None:
    tree = ast.parse(module.path.read_text(), str(module.path))
    package = module.name if module.is_package else module.name.rpartition(".")[0]

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                continue
            child_lazy = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            for name in _imported_names(child, package, modules):
                (module.lazy if child_lazy else module.eager).add(name)
            visit(child, child_lazy)

    visit(tree, False)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(node: ast.AST, package: str, modules: dict[str, Module]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
    names = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    return names or [base]


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _is_library(name: str) -> bool:
    return name.startswith("pagoda") and not _matches(name, ("pagoda.services", "pagoda.kernels"))


MODULES = discover()


def test_graph_is_not_empty():
    assert "pagoda.core.scheduler" in MODULES and "pagoda.services.gateway.app" in MODULES
    assert "pagoda.messages" in MODULES["pagoda.core.scheduler"].eager


def test_the_engine_library_imports_no_service_code():
    offences = sorted(f"{m.name} imports {imp}" for m in MODULES.values() if _is_library(m.name)
                      for imp in m.all_imports if _matches(imp, LIBRARY_FORBIDDEN))
    assert not offences, "\n".join(offences)


def test_the_gateway_imports_no_model_worker_or_sampler_code():
    gateway = [m for m in MODULES.values() if m.name.startswith("pagoda.services.gateway")]
    assert gateway
    offences = []
    for module in gateway:
        for imp in module.all_imports:
            if _matches(imp, GATEWAY_FORBIDDEN):
                offences.append(f"{module.name} imports {imp}")
        for name, chain in _eager_closure(module.name).items():
            if _matches(name, GATEWAY_FORBIDDEN):
                offences.append(f"{module.name} loads {name} via {' -> '.join(chain)}")
    assert not offences, "\n".join(sorted(set(offences)))


def _eager_closure(start: str) -> dict[str, list[str]]:
    """Every module that importing `start` executes, with one import chain to each."""
    seen = {start: [start]}
    frontier = [start]
    while frontier:
        name = frontier.pop()
        targets = set(MODULES[name].eager) if name in MODULES else set()
        # Importing a.b.c runs a/__init__ and a/b/__init__ first.
        parts = name.split(".")
        targets |= {".".join(parts[:i]) for i in range(1, len(parts))}
        for target in targets:
            if target not in seen:
                seen[target] = [*seen[name], target]
                if target in MODULES:
                    frontier.append(target)
    return seen


def test_no_import_cycles():
    cycles = [c for c in _strongly_connected(
        {m.name: {i for i in m.all_imports if i in MODULES and i != m.name} for m in MODULES.values()})
        if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph has hundreds of nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(component)
    return components


@pytest.mark.parametrize("graph,expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_cycle_finder_itself(graph, expected):
    found = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert found == expected

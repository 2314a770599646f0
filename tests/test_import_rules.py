"""The boundaries ../shared/ARCHITECTURE.md states, checked over the real import graph.

Layers point one way: services -> library -> kernels.

* The engine library (`libs/pagoda`) imports no service code and none of the service
  stack's packages (gRPC, protobuf, FastAPI, uvicorn, Redis), not even lazily.
* The kernels (`pagoda.kernels`) are a leaf: they import only torch, triton, numpy, the
  standard library and each other; the library calls into them, never the reverse.
* `pagoda.distributed` (communication, process groups, parallel state, wire codec)
  imports none of the layers that use it: model, sampler, worker, executor, engine,
  entry points.
* A service imports no other service's package; what two services share (the wire
  messages and their constants) lives in `pagoda.services.common`. The exceptions are
  the two front ends, which are no service: `services/cli` starts every service by
  module path and shares the gateway's request checks (`run_batch`) and each service's
  flags; `services/bench` measures a cluster that it starts through `services/cli`.
  One service borrows another's code on purpose: `services/epp` (the endpoint picker)
  serves the gateway's router over Envoy's ext_proc, so it imports the gateway's
  routing package (peers, router, prefix index) and its error type, and nothing else
  of the gateway (no HTTP app); the router is reused, not copied.
* The gateway (and the endpoint picker) imports no model, worker, sampler or kernel code, directly or through
  what it imports at module level; it may share the plain message types of
  `pagoda.messages`.
* No import cycle among first-party modules (lazy imports inside functions count: a
  cycle hidden in a function body still ties the modules together). Importing `a.b.c`
  runs `a/__init__` and `a/b/__init__` first, and `from a import b` asks `a` for the
  attribute `b`, which runs a module-level `a.__getattr__` when `b` is not loaded yet:
  the graph holds those edges too.
* An import inside a function carries a comment with `lazy:` and the reason (on its
  line, or on the line above it or above the block of imports it opens): heavy and
  optional, must not load in that process, or a cycle that cannot be untied.

The graph is built from the source with `ast`, so the test needs no import of torch
and runs in well under a second.
"""

from __future__ import annotations

import ast
import sys
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
KERNEL_ALLOWED = ("pagoda.kernels", "torch", "triton", "numpy", *sys.stdlib_module_names)
# The layers above the group's plumbing: the model's parallel layers use its collectives.
DISTRIBUTED_FORBIDDEN = ("pagoda.model", "pagoda.sample", "pagoda.worker", "pagoda.executor",
                         "pagoda.engine", "pagoda.entrypoints", "pagoda.core", "pagoda.services")
SERVICES = ("gateway", "scheduler", "gpu_worker", "tokenizer", "kv_cache_manager", "epp")
# Packages every service may import from (the wire package, shared helpers, the stubs).
SERVICE_SHARED = ("pagoda.services.common", "pagoda.services._proto")
# Front ends (no service) and what each may import beyond the shared packages.
FRONT_ENDS = {"pagoda.services.cli": tuple(f"pagoda.services.{s}" for s in SERVICES),
              "pagoda.services.bench": ("pagoda.services.cli",)}
# The gateway's pieces the endpoint picker reuses (and the package above them, whose
# __init__ importing them runs): the router and its error type.
BORROWED = {"pagoda.services.epp": ("pagoda.services.gateway.routing",
                                    "pagoda.services.gateway.errors")}


class Module:
    """One first-party module: its name, file, and the modules its imports name.

    `eager` holds imports that run when the module is imported (module level, not under
    `if TYPE_CHECKING:`); `lazy` those inside function bodies; `lazy_sites` each
    in-function import statement as (line, text, says why: a `lazy:` comment)."""

    def __init__(self, name: str, path: Path, is_package: bool):
        self.name, self.path, self.is_package = name, path, is_package
        self.eager: set[str] = set()
        self.lazy: set[str] = set()
        self.lazy_sites: list[tuple[int, str, bool]] = []
        self.has_getattr = False  # a module-level __getattr__ (PEP 562)

    @property
    def all_imports(self) -> set[str]:
        return self.eager | self.lazy

    @property
    def rel_path(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def discover(roots: dict[str, Path] = ROOTS) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package, folder in roots.items():
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
    trees = {m.name: ast.parse(m.path.read_text(), str(m.path)) for m in modules.values()}
    for module in modules.values():
        module.has_getattr = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                                 for n in trees[module.name].body)
    for module in modules.values():
        _collect_imports(module, trees[module.name], modules)
    return modules


def _collect_imports(module: Module, tree: ast.Module, modules: dict[str, Module]) -> None:
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    lines = module.path.read_text().splitlines()
    import_lines = {i for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for i in range(node.lineno - 1, node.end_lineno)}

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                continue
            child_lazy = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            names = _imported_names(child, package, modules)
            for name in names:
                (module.lazy if child_lazy else module.eager).add(name)
            if names and child_lazy:
                module.lazy_sites.append((child.lineno, lines[child.lineno - 1].strip(),
                                          _says_lazy(lines, import_lines, child)))
            visit(child, child_lazy)

    visit(tree, False)
    # What importing those names runs besides them: the __init__ of each package above
    # them that is not above this module too (those have run already).
    own = _ancestors(module.name) | {module.name}
    for imports in (module.eager, module.lazy):
        imports |= {a for name in list(imports) for a in _ancestors(name)
                    if a not in own and a in modules}


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _says_lazy(lines: list[str], import_lines: set[int], node: ast.stmt) -> bool:
    """A `lazy:` comment on the import's lines, or in the comment just above it or
    above the run of import statements it belongs to (one comment may cover a block)."""
    above = node.lineno - 2
    while above in import_lines:
        above -= 1
    while above >= 0 and lines[above].lstrip().startswith("#"):
        if "lazy:" in lines[above]:
            return True
        above -= 1
    return any("lazy:" in line for line in lines[node.lineno - 1:node.end_lineno])


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
    if names and base in modules and modules[base].has_getattr:
        # ... after asking `pkg` for the attribute: its __getattr__ runs if `sub` is not
        # loaded yet (pagoda's imports the LLM, the whole engine).
        names.append(base)
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
    gateway = [m for m in MODULES.values()
               if m.name.startswith(("pagoda.services.gateway", "pagoda.services.epp"))]
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


def test_the_kernels_import_only_torch_triton_and_themselves():
    kernels = [m for m in MODULES.values() if m.name.startswith("pagoda.kernels")]
    assert kernels
    offences = sorted(f"{m.name} imports {imp}" for m in kernels for imp in m.all_imports
                      if not _matches(imp, KERNEL_ALLOWED) and imp != "pagoda")
    assert not offences, "\n".join(offences)


def test_distributed_imports_none_of_the_layers_that_use_it():
    offences = sorted(f"{m.name} imports {imp}" for m in MODULES.values()
                      if _matches(m.name, ("pagoda.distributed",))
                      for imp in m.all_imports if _matches(imp, DISTRIBUTED_FORBIDDEN))
    assert not offences, "\n".join(offences)


def test_no_service_imports_another_services_code():
    offences = []
    for module in MODULES.values():
        owner = _service_package(module.name)
        if owner is None:
            continue
        allowed = (owner, *SERVICE_SHARED, *FRONT_ENDS.get(owner, ()), *BORROWED.get(owner, ()))
        packages = {_service_package(b) for b in BORROWED.get(owner, ())}
        offences += [f"{module.name} imports {imp}" for imp in module.all_imports
                     if _service_package(imp) and not _matches(imp, allowed)
                     and imp not in packages]
    assert not offences, "\n".join(sorted(offences))


def _service_package(name: str) -> str | None:
    """`pagoda.services.<x>` for a module under services/<x>/, else None."""
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["pagoda", "services"] and len(parts) > 2 else None


def test_every_in_function_import_says_why_it_is_lazy():
    offences = [f"{m.rel_path}:{line}: {text}" for m in MODULES.values()
                for line, text, says_why in m.lazy_sites if not says_why]
    assert not offences, ("hoist these imports to the module top, or say why they must "
                          "stay in the function (`# lazy: ...`):\n" + "\n".join(sorted(offences)))


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


def test_a_from_import_through_a_lazy_package_getattr_is_an_edge(tmp_path):
    """`from pkg import sub` runs pkg.__getattr__, whose import closes a cycle."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        "def __getattr__(name):\n    from pkg.front import Front  # lazy: cheap import\n")
    (tmp_path / "pkg" / "front.py").write_text("import pkg.util\n")
    (tmp_path / "pkg" / "util.py").write_text("from pkg import envs\n")
    (tmp_path / "pkg" / "envs.py").write_text("")
    modules = discover({"pkg": tmp_path / "pkg"})
    graph = {m.name: {i for i in m.all_imports if i in modules and i != m.name}
             for m in modules.values()}
    assert [sorted(c) for c in _strongly_connected(graph) if len(c) > 1] == [
        ["pkg", "pkg.front", "pkg.util"]]


@pytest.mark.parametrize("graph,expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_cycle_finder_itself(graph, expected):
    found = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert found == expected

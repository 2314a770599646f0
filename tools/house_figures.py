"""House-keeping figures of a source tree: back-pointing imports, in-function imports,
the largest files, the gateway's layout, `schedule()`'s length, `ModelArchConfig`'s fields.

    python3 tools/house_figures.py .          # this checkout
    git worktree add /tmp/old REV && python3 tools/house_figures.py /tmp/old

A back-pointing import is an import statement from a lower layer to a higher one:
kernels -> anything first-party outside kernels; distributed/ -> worker, executor,
engine, model, sample, entrypoints, core; the library -> services; one service's
package -> another's (the CLI, bench and common are front ends or shared, not services).
"""
import ast, pathlib, sys, collections, re
root = pathlib.Path(sys.argv[1])
ROOTS = {"pagoda.services": root/"services", "pagoda.kernels": root/"kernels", "pagoda": root/"libs"/"pagoda"}
mods = {}
for pkg, folder in ROOTS.items():
    for p in sorted(folder.rglob("*.py")):
        if "_proto" in p.parts: continue
        parts = list(p.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__": parts = parts[:-1]
        name = ".".join([pkg, *parts])
        mods.setdefault(name, p)
def imports(p, name):
    t = ast.parse(p.read_text()); out = []; lazy = 0
    pkg = name if p.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(t):
        if isinstance(node, ast.Import): out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")[:len(pkg.split("."))-node.level+1]
                base = ".".join([*anchor, base] if base else anchor)
            out += [base]
    for f in ast.walk(t):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lazy += sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(f))
    return out, lazy
def layer(n):
    if n.startswith("pagoda.kernels"): return "kernels"
    if n.startswith("pagoda.services."): return "service:" + n.split(".")[2]
    if n.startswith("pagoda.distributed"): return "distributed"
    if n.startswith("pagoda"): return "library"
    return None
back = []; lazy_total = 0
UP_FROM_DIST = ("pagoda.worker", "pagoda.executor", "pagoda.engine", "pagoda.model", "pagoda.sample", "pagoda.entrypoints", "pagoda.core")
FRONTS = ("cli", "bench", "common", "_proto")
for name, p in mods.items():
    imps, lz = imports(p, name); lazy_total += lz
    a = layer(name)
    for i in imps:
        b = layer(i)
        if b is None: continue
        if a == "kernels" and b != "kernels": back.append((name, i))
        elif a == "distributed" and i.startswith(UP_FROM_DIST): back.append((name, i))
        elif a in ("library", "distributed") and b.startswith("service"): back.append((name, i))
        elif a.startswith("service:") and b.startswith("service:") and a != b \
                and a.split(":")[1] not in FRONTS and b.split(":")[1] not in ("common", "_proto"):
            back.append((name, i))
print("back-pointing imports:", len(back))
for x in back: print("   ", *x)
print("in-function imports:", lazy_total)
sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in mods.values()), reverse=True)
print("largest files:", sizes[:6])
print("files over 400 lines:", [s for s in sizes if s[0] > 400])
gw = root/"services"/"gateway"
print("gateway top-level modules:", len(list(gw.glob("*.py"))), "sub-packages:", len([d for d in gw.iterdir() if (d/"__init__.py").exists()]))
src = (root/"libs/pagoda/core/scheduler.py").read_text()
t = ast.parse(src)
for n in ast.walk(t):
    if isinstance(n, ast.FunctionDef) and n.name == "schedule":
        print("schedule() lines:", n.end_lineno - n.lineno + 1)
print("scheduler.py lines:", len(src.splitlines()))
cfg = (root/"libs/pagoda/config.py").read_text()
t = ast.parse(cfg)
for n in t.body:
    if isinstance(n, ast.ClassDef) and n.name == "ModelArchConfig":
        print("ModelArchConfig fields:", sum(isinstance(b, ast.AnnAssign) for b in n.body))

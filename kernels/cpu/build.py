"""Compile `csrc/pagoda_cpu_ops.cpp` into a shared library, once per machine and source.

    python -m pagoda.kernels.cpu.build      # what `make install` runs; prints the path

The library lands in `<cache>/cpu_kernels/<key>/pagoda_cpu_ops.so`, where <cache> is
PAGODA_CACHE_DIR, else $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda, and <key> hashes
the sources (every file in csrc/), the flags, torch's version, the compiler's version and the CPU's model and
features: a change to any of them builds a new library beside the old one, and a library is never rebuilt in place.
Invariants: a library path that exists is complete (it is compiled to a temporary name
and renamed); two processes building at once serialise on a lock file, and the second
finds the first one's result.

Plain g++ against torch's headers and libraries (no ninja, no pybind: the ops register
through TORCH_LIBRARY and load with `torch.ops.load_library`): about 15 s on 2 cores.
`-march=native`, since the library is built where it runs (set PAGODA_CPU_ARCH_FLAGS to
build for another machine, e.g. in an image).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from pagoda.kernels.cache_dir import cache_root

SOURCE = Path(__file__).resolve().parent / "csrc" / "pagoda_cpu_ops.cpp"
LIBRARY_NAME = "pagoda_cpu_ops.so"


class BuildError(RuntimeError):
    """The library could not be compiled (no compiler, or it failed: the log is attached)."""


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise BuildError("no C++ compiler (g++) on PATH")
    return cxx


def _flags() -> list[str]:
    # lazy: cpp_extension loads setuptools (~0.2 s), needed only to build or find the library
    from torch.utils.cpp_extension import include_paths, library_paths

    arch = os.environ.get("PAGODA_CPU_ARCH_FLAGS", "-march=native").split()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = library_paths()
    return ["-O3", *arch, "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *[f"-I{p}" for p in include_paths()],
            *[f"-L{p}" for p in libs], *[f"-Wl,-rpath,{p}" for p in libs],
            "-ltorch", "-ltorch_cpu", "-lc10"]


def _cpu_features() -> str:
    """This CPU's model and feature flags: a library built with -march=native elsewhere
    (a shared home directory) must not load here."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def library_path() -> Path:
    """Where the library for this source, torch, compiler and flags lives (built or not)."""
    cxx = compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    sources = sorted(SOURCE.parent.iterdir())  # the .cpp and the headers it includes
    for part in (*(path.read_bytes() for path in sources), torch.__version__.encode(),
                 version.encode(),
                 " ".join(_flags()).encode(), _cpu_features().encode()):
        digest.update(part)
    return cache_root() / "cpu_kernels" / digest.hexdigest()[:16] / LIBRARY_NAME


def build() -> Path:
    """The library's path, compiling it first if no complete one exists."""
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # another process built it while this one waited
            return path
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        cmd = [compiler(), str(SOURCE), "-o", str(tmp), *_flags()]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise BuildError(f"compiling {SOURCE.name} failed ({result.returncode}):\n"
                             f"{result.stderr[-4000:]}")
        os.replace(tmp, path)
    return path


def main() -> int:
    try:
        print(build())
    except BuildError as exc:  # the torch path still works: say so, do not fail install
        print(f"pagoda CPU kernels not built, the plain torch path will be used: {exc}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

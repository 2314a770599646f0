"""The model registry: HF architecture names and GGUF architectures -> how Pagoda runs them.

Every module of `pagoda.model.architectures` declares a module-level `ARCHITECTURES`
tuple of `ModelArchitecture`. The registry finds those modules with `pkgutil` and
imports them on its first lookup, not when it is imported itself (importing the
registry costs no torch). So adding an architecture is one new file in that folder
plus its test; nothing else lists it. `register` adds one from anywhere else (an
out-of-tree plugin, a test).

The config parser (`hf_config`), the GGUF reader (`gguf_loader`) and the loader
(`loader`) ask `MODEL_REGISTRY`; none of them names an architecture.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import pkgutil
import threading
from collections.abc import Sequence

from pagoda.model.arch_spec import GGUFLayout, ModelArchitecture

ARCHITECTURE_PACKAGES = ("pagoda.model.architectures",)

logger = logging.getLogger(__name__)


class ModelRegistry:
    """HF class name -> `ModelArchitecture`, filled from `packages` on first use.

    Invariant: each HF name maps to exactly one entry (a second registration of a name
    raises instead of silently replacing the first); after the first lookup every
    module of `packages` has been imported once and the entries of every module that
    imported are present. A module that raises on import (a bug, a missing optional
    package) costs only its own architectures: it is logged, and a lookup that finds no
    entry names it and its error, so one broken family never stops the others loading.
    A module that imports but declares no table is still an error for everyone: that is
    a programming mistake the tests must catch, not a runtime condition.
    """

    def __init__(self, packages: Sequence[str] = ARCHITECTURE_PACKAGES) -> None:
        self._packages = tuple(packages)
        self._architectures: dict[str, ModelArchitecture] = {}
        self._broken: dict[str, str] = {}  # module name -> its import error
        self._discovered = False
        self._discovering = False  # an architecture module calling `register` on import
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ registration
    def register(self, architecture: ModelArchitecture) -> None:
        """Add an architecture; ValueError when its HF name is already registered."""
        with self._lock:
            self._discover()
            self._add(architecture, "register()")

    def unregister(self, hf_name: str) -> None:
        """Remove an entry (a plugin unloading, a test cleaning up); KeyError if absent."""
        with self._lock:
            self._discover()
            del self._architectures[hf_name]

    def _add(self, architecture: ModelArchitecture, source: str) -> None:
        name = architecture.hf_name
        if name in self._architectures:
            raise ValueError(f"Architecture {name!r} from {source} is already registered "
                             f"(model class {self._architectures[name].model_cls.__name__})")
        self._architectures[name] = architecture

    def _discover(self) -> None:
        """Import every architecture module once and add its table (caller holds the lock)."""
        if self._discovered or self._discovering:
            return
        self._discovering = True
        try:
            for package_name in self._packages:
                package = importlib.import_module(package_name)
                for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
                    if info.name.startswith("_"):
                        continue
                    module_name = f"{package_name}.{info.name}"
                    try:
                        module = importlib.import_module(module_name)
                    except Exception as exc:  # noqa: BLE001 - any import failure isolates that file
                        self._broken[module_name] = f"{type(exc).__name__}: {exc}"
                        logger.error("architecture module %s failed to import; its architectures "
                                     "are unavailable: %s", module_name, self._broken[module_name])
                        continue
                    table = getattr(module, "ARCHITECTURES", None)
                    if table is None:
                        raise ImportError(f"{module.__name__} is in an architecture package but "
                                          "declares no ARCHITECTURES table")
                    for architecture in table:
                        self._add(architecture, module.__name__)
            self._discovered = True
        except BaseException:
            self._architectures.clear()  # all or nothing: a retry starts from scratch
            self._broken.clear()
            raise
        finally:
            self._discovering = False

    # ------------------------------------------------------------------ lookups
    def supported_architectures(self) -> list[str]:
        with self._lock:
            self._discover()
            return sorted(self._architectures)

    def supported_gguf_architectures(self) -> list[str]:
        with self._lock:
            self._discover()
            return sorted({g for a in self._architectures.values() for g in a.gguf_layouts})

    def resolve(self, architectures: str | Sequence[str]) -> ModelArchitecture:
        """The entry of the first supported name (config.json may list several, as in vLLM).

        ValueError naming the given and the supported architectures when none is known.
        """
        names = [architectures] if isinstance(architectures, str) else list(architectures)
        with self._lock:
            self._discover()
            for name in names:
                if name in self._architectures:
                    return self._architectures[name]
        supported = self.supported_architectures()
        nearest = difflib.get_close_matches(names[0], supported, n=1, cutoff=0.5) if names \
            else []
        hint = f" (the nearest supported: {nearest[0]})" if nearest else ""
        raise ValueError(f"Model architectures {names} are not supported{hint}; supported "
                         f"architectures: {', '.join(supported)}{self._broken_note()}")

    def _broken_note(self) -> str:
        """Why some architectures may be missing: the modules that failed to import."""
        if not self._broken:
            return ""
        listed = "; ".join(f"{name} ({error})" for name, error in sorted(self._broken.items()))
        return f". These architecture modules failed to import, so their architectures are unavailable: {listed}"

    def resolve_gguf(self, gguf_architecture: str,
                     model_name: str = "") -> tuple[ModelArchitecture, GGUFLayout]:
        """The entry running GGUF `general.architecture`, and that format's tensor names.

        Several HF architectures may run one GGUF architecture (llama.cpp writes Mistral
        as "llama"): the one whose family appears in `general.name` (`model_name`) wins,
        else the one named after the GGUF architecture itself, else the first registered.
        """
        with self._lock:
            self._discover()
            candidates = [a for a in self._architectures.values()
                          if gguf_architecture in a.gguf_layouts]
        if not candidates:
            raise ValueError(f"GGUF architecture {gguf_architecture!r} is not supported; "
                             f"supported: {', '.join(self.supported_gguf_architectures())}"
                             f"{self._broken_note()}")
        lowered = model_name.lower()
        named = [a for a in candidates if a.family != gguf_architecture and a.family in lowered]
        primary = [a for a in candidates if a.family == gguf_architecture]
        chosen = (named or primary or candidates)[0]
        return chosen, chosen.gguf_layouts[gguf_architecture]


MODEL_REGISTRY = ModelRegistry()

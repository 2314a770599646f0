"""The LoRA adapters this gateway serves by name (vLLM's `--lora-modules` and the
runtime load/unload endpoints' registry).

A request whose `model` is an adapter's name runs on the base model with that
adapter (`LoRARequest`); `/v1/models` lists each adapter with `parent` = the base
model. An adapter's id is derived from its name and path (`adapter_id`), so every
gateway of a cluster gives the same adapter the same id without talking to the
others, and an adapter loaded again under its old name from another path gets a new
id (the replicas key its cached KV blocks by name and id: no stale prefix hits).

Invariant: names are unique; each name maps to one `LoRARequest` until unloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
from dataclasses import dataclass

import pagoda.envs as envs
from pagoda.lora.request import LoRARequest
from pagoda.services.gateway.shared_state import shared_path



@dataclass(frozen=True)
class LoRAModulePath:
    """vLLM's: one `--lora-modules` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON ({exc})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                or not isinstance(spec.get("path"), str):
            raise argparse.ArgumentTypeError(
                '--lora-modules: the JSON form needs string "name" and "path"')
        base = spec.get("base_model_name")
        return _module(spec["name"], spec["path"], base if isinstance(base, str) else None)
    name, sep, path = value.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(
            f"--lora-modules: {value!r} is neither name=path nor a JSON object")
    return _module(name, path, None)


def _module(name: str, path: str, base: str | None) -> LoRAModulePath:
    if not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError("--lora-modules: the name and the path must not be empty")
    return LoRAModulePath(name.strip(), path.strip(), base)


def adapter_id(name: str, path: str) -> int:
    """A positive 62-bit id, the same for the same (name, path) in every gateway."""
    digest = hashlib.blake2b(f"{name}\0{os.path.normpath(path)}".encode(),
                             digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 2) + 1


def runtime_updates_allowed(flag: bool) -> bool:
    """`--allow-runtime-lora-updating`, or PAGODA_/VLLM_ALLOW_RUNTIME_LORA_UPDATING set."""
    return flag or bool(envs.get("PAGODA_ALLOW_RUNTIME_LORA_UPDATING"))


class LoRARegistry:
    """name -> (LoRARequest, parent model name or None for the base's first name).

    `shared_file` (the API servers of one gateway, shared_state.py): the registry after
    the last runtime change, kept in that JSON file; every process rereads it when it
    changed (a stat per lookup), so an adapter loaded through one process is served by
    all. Changes are serialized by an flock and the file is replaced whole, so a reader
    never sees half of one. Without it (one process) the registry is this object."""

    def __init__(self, modules: list[LoRAModulePath] | None = None,
                 runtime_updates: bool = False, shared_file: str | None = None) -> None:
        self.runtime_updates = runtime_updates
        self.shared_file = shared_file
        self._seen: tuple | None = None  # the shared file's (inode, mtime, size) last read
        self._adapters: dict[str, tuple[LoRARequest, str | None]] = {}
        for module in modules or []:
            if module.name in self._adapters:
                raise ValueError(f"--lora-modules names {module.name!r} twice")
            self._put(module.name, module.path, module.base_model_name)

    def get(self, name: str | None) -> LoRARequest | None:
        self._sync()
        entry = self._adapters.get(name) if name else None
        return entry[0] if entry else None

    def __contains__(self, name: object) -> bool:
        self._sync()
        return name in self._adapters

    def __len__(self) -> int:
        self._sync()
        return len(self._adapters)

    def add(self, name: str, path: str, parent: str | None = None) -> LoRARequest:
        """Register (or replace) an adapter; its request."""
        with self._changing():
            return self._put(name, path, parent)

    def remove(self, name: str) -> bool:
        with self._changing():
            return self._adapters.pop(name, None) is not None

    def items(self) -> list[tuple[LoRARequest, str | None]]:
        self._sync()
        return list(self._adapters.values())

    def _put(self, name: str, path: str, parent: str | None) -> LoRARequest:
        lora = LoRARequest(name, adapter_id(name, path), path)
        self._adapters[name] = (lora, parent)
        return lora

    def _sync(self) -> None:
        """Reread the shared file if another process changed it."""
        if self.shared_file is None:
            return
        try:
            st = os.stat(self.shared_file)
        except FileNotFoundError:
            return  # no runtime change yet: every process has the same flags
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._seen:
            return
        with open(self.shared_file) as f:
            entries = json.load(f)
        self._adapters = {}
        for name, path, parent in entries:
            self._put(name, path, parent)
        self._seen = stamp

    @contextlib.contextmanager
    def _changing(self):
        """Around a runtime change: the latest shared registry in, the result out."""
        if self.shared_file is None:
            yield
            return
        with open(f"{self.shared_file}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one change at a time, across processes
            self._sync()
            yield
            tmp = f"{self.shared_file}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump([[lora.lora_name, lora.lora_path, parent]
                           for lora, parent in self._adapters.values()], f)
            os.replace(tmp, self.shared_file)
            self._seen = None  # reread (and stamp) our own write on the next lookup


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (vLLM's flags; the replicas need "
                                      "--enable-lora)")
    group.add_argument("--lora-modules", type=parse_lora_module, nargs="+", default=None,
                       metavar="NAME=PATH",
                       help="Adapters served by name: name=path, or the JSON form "
                            '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": '
                            '"..."}\'. The path is read by the replicas.')
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                            "(also on with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true).")


def lora_flags(args: argparse.Namespace) -> list[str]:
    """The LoRA flags the user set, re-rendered for the gateway (`pagoda serve`)."""
    flags: list[str] = []
    if args.lora_modules:
        flags.append("--lora-modules")
        flags += [json.dumps({"name": m.name, "path": m.path,
                              **({"base_model_name": m.base_model_name}
                                 if m.base_model_name else {})})
                  for m in args.lora_modules]
    if args.allow_runtime_lora_updating:
        flags.append("--allow-runtime-lora-updating")
    return flags


def registry_from_args(args: argparse.Namespace) -> LoRARegistry:
    return LoRARegistry(getattr(args, "lora_modules", None),
                        runtime_updates_allowed(getattr(args, "allow_runtime_lora_updating",
                                                        False)),
                        shared_file=shared_path("lora_adapters.json"))

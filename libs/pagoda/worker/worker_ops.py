"""The worker methods `LLM.collective_rpc` may call on every rank, by name, and the
way a callable reaches a rank (vLLM: `collective_rpc(method, args, kwargs)` runs
`worker.method(*args, **kwargs)`, or `method(worker, *args, **kwargs)` for a callable).

`WorkerOps` is that worker: it wraps one rank's model runner and holds what sleep
mode and weight transfer keep between calls. Only the methods in `RPC_METHODS` are
reachable by name: a name is data from the caller, never an attribute lookup on
arbitrary objects.

A callable sent to a worker group travels as `module:qualname` and is imported on
each follower rank (the ranks are this driver's own children, started with its
environment): it must be a module-level function. Rank 0 runs the object itself.
"""

from __future__ import annotations

import importlib
import json
import logging
from typing import Any, Callable

import torch

from pagoda.distributed import weight_transfer as transfer
from pagoda.model import cpu_packed_weights
from pagoda.model.weight_names import expected_hf_names
from pagoda.worker.sleep_mode import SleepState

logger = logging.getLogger(__name__)

RPC_METHODS = ("sleep", "wake_up", "is_sleeping", "reload_weights", "apply_model",
               "init_weight_transfer_engine", "update_weights",
               "shutdown_weight_transfer_engine", "get_model", "weight_bytes", "kv_cache_bytes")
_CALLABLE_PREFIX = "callable:"


class WorkerOps:
    """One rank's worker, as `collective_rpc` sees it. `rank`: its rank in the group."""

    def __init__(self, runner, rank: int = 0) -> None:
        self.model_runner = runner
        self.rank = rank
        self.sleep_state = SleepState()
        self.transfer_group = None

    # ------------------------------------------------------------ model access
    def get_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def apply_model(self, func: Callable | str) -> Any:
        """`func(model)`; `func` may be a `callable_name` (how it reaches other ranks)."""
        return (resolve_callable(func) if isinstance(func, str) else func)(self.get_model())

    def weight_bytes(self) -> int:
        """Bytes of parameter storage this rank holds on its device (0 while asleep)."""
        return sum(p.numel() * p.element_size() for p in self.model_runner.model.parameters())

    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for pair in self.model_runner.kv_caches for t in pair)

    # ------------------------------------------------------------ sleep mode
    def sleep(self, level: int = 1) -> None:
        self.sleep_state.sleep(self.model_runner, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleep_state.wake_up(self.model_runner, tags)

    def is_sleeping(self) -> bool:
        return self.sleep_state.is_sleeping

    # ------------------------------------------------------------ weights
    def reload_weights(self) -> None:
        """Load the checkpoint the engine started from into the current parameters
        (after `sleep(level=2)` and `wake_up(["weights"])`, vLLM's reload)."""
        from pagoda.model.loader import iter_checkpoint_weights  # lazy: file readers

        model = self._loadable_model()
        include = (model.needs_checkpoint_tensor
                   if self.model_runner.parallel.world_size > 1 else None)
        config = self.model_runner.config
        with torch.no_grad():
            model.load_weights(iter_checkpoint_weights(config.model, config.arch, include))
        self.sleep_state.weights_need_loading = False

    def init_weight_transfer_engine(self, init_info: dict, backend: str | None = None) -> None:
        """Join the trainer's transfer group as rank `rank_offset + rank`."""
        info = transfer.WeightTransferInitInfo.parse(init_info)
        if self.transfer_group is not None:
            raise RuntimeError("The weight transfer engine is already initialized")
        backend = backend or transfer.backend_for(self.model_runner.device)
        self.transfer_group = transfer.join(info.master_address, info.master_port,
                                            info.rank_offset + self.rank, info.world_size,
                                            backend)

    def update_weights(self, update_info: dict) -> None:
        """Receive one round of named tensors from the trainer and load them in place.
        Every weight of the model must be in the round (a whole-model sync): a missing
        one is refused before anything is received."""
        if self.transfer_group is None:
            raise RuntimeError("init_weight_transfer_engine must be called before update_weights")
        info = transfer.WeightTransferUpdateInfo.parse(update_info)
        model = self._loadable_model()
        names = set(info.names)
        if "model.embed_tokens.weight" in names:
            names.add("lm_head.weight")  # a tied head is a copy of the embedding
        missing = sorted(expected_hf_names(model) - names)
        if missing:
            raise ValueError(f"update_info.names lacks {len(missing)} weight(s) of the model "
                             f"(each round carries every weight): {', '.join(missing[:5])}")
        received = list(transfer.receive_weights(info, self.transfer_group,
                                                 self.model_runner.device))
        with torch.no_grad():
            model.load_weights(received)
        self.sleep_state.weights_need_loading = False

    def shutdown_weight_transfer_engine(self) -> None:
        self.transfer_group = None

    def _loadable_model(self):
        """The model, if weights can be loaded into it as they stand: not asleep, and not
        repacked at load time (bf16 CPU packing, 4-bit GGUF packing, batch-invariant
        rows), whose parameters no longer have the checkpoint's layout."""
        if "weights" in self.sleep_state.asleep:
            raise RuntimeError("The weights are asleep; call wake_up(tags=['weights']) first")
        runner, config = self.model_runner, self.model_runner.config
        if (cpu_packed_weights.applies(runner.device, runner.dtype) or config.gguf_int4
                or config.batch_invariant or config.arch.quantization_config):
            raise NotImplementedError(
                "Loading new weights into a running engine needs plain (unquantized, "
                "unpacked) parameters; this engine repacked or quantized them at load time")
        return runner.model

    # ------------------------------------------------------------ dispatch
    def call(self, method: str | Callable, args: tuple | list = (),
             kwargs: dict | None = None) -> Any:
        """Run `method` (a name in RPC_METHODS, or a callable given this worker)."""
        if callable(method):
            return method(self, *args, **(kwargs or {}))
        if method.startswith(_CALLABLE_PREFIX):
            return resolve_callable(method)(self, *args, **(kwargs or {}))
        if method not in RPC_METHODS:
            raise ValueError(f"Unknown worker method {method!r}; collective_rpc can call "
                             f"{', '.join(RPC_METHODS)}, or a callable taking the worker")
        return getattr(self, method)(*args, **(kwargs or {}))


def callable_name(func: Callable) -> str:
    """How a callable travels to a group's other ranks; TypeError if it cannot."""
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", "")
    if not module or not qualname or "<" in qualname:
        raise TypeError(f"{func!r} cannot reach a worker group's other ranks: pass a "
                        "module-level function (ranks import it by name), or a method name")
    return f"{_CALLABLE_PREFIX}{module}:{qualname}"


def resolve_callable(name: str) -> Callable:
    module, _, qualname = name.removeprefix(_CALLABLE_PREFIX).partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{name} is not callable")
    return obj


def rpc_outcome(ops: WorkerOps, method: str, payload: str, encode: bool):
    """Run one `collective_rpc` call on a group's rank: {"ok": result} or {"error":
    why}, as JSON text when `encode` (a follower's result travels to rank 0; a tensor
    travels as nested lists)."""
    try:
        raw = json.loads(payload)
        outcome: dict = {"ok": ops.call(method, raw.get("args", ()), raw.get("kwargs") or {})}
    except Exception as exc:  # noqa: BLE001 - the caller's error, reported at rank 0
        logger.warning("collective_rpc %s failed on rank %d: %s", method, ops.rank, exc)
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
    if not encode:
        return outcome
    try:
        return json.dumps(outcome, default=_as_json)
    except (TypeError, ValueError) as exc:
        return json.dumps({"error": f"the result of rank {ops.rank} cannot travel to rank 0 "
                                    f"({exc}): return JSON-serializable values or tensors"})


def _as_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")

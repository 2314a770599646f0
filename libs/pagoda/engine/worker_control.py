"""Engine-level sleep mode and weight updates, over the executor's `collective_rpc`.

What the engine adds to the ranks' own work (`pagoda.worker.worker_ops`):
- it refuses while requests are in flight: vLLM's sleep needs an idle engine, and a
  weight update under running requests would mix two models in one answer. The
  caller finishes or aborts them first (the error says how many);
- it drops the prefix cache when KV contents stop being valid (sleep frees them; new
  weights make every cached block stale): no block cached before is ever served after;
- while asleep (or woken from level 2 with weights not loaded yet) every new request
  is refused with `EngineSleeping`, a clear error instead of a hang or garbage.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.engine.engine_core import EngineCore

_TAGS = ("weights", "kv_cache")


class EngineSleeping(RuntimeError):
    """A request reached an engine that is asleep."""


@dataclasses.dataclass
class SleepStatus:
    """The driver's record of what sleeps on the ranks (they hold the same)."""

    level: int = 0
    asleep: set[str] = dataclasses.field(default_factory=set)
    weights_need_loading: bool = False  # woken from level 2, not loaded since

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def check_awake(self) -> None:
        if self.asleep:
            raise EngineSleeping(f"The engine is sleeping (level {self.level}; asleep: "
                                 f"{', '.join(sorted(self.asleep))}); call wake_up() first")
        if self.weights_need_loading:
            raise EngineSleeping("The engine woke up from sleep level 2 without weights: load "
                                 "them (update_weights, or collective_rpc('reload_weights'))")


def sleep(core: "EngineCore", level: int = 1) -> None:
    if not core.config.enable_sleep_mode:
        raise ValueError("Sleep mode is not enabled: create the engine with "
                         "enable_sleep_mode=True")
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    if core.sleep.is_sleeping:
        raise RuntimeError("The engine is already sleeping; call wake_up() first")
    _require_idle(core, "sleep")
    core.executor.collective_rpc("sleep", (level,))
    _drop_prefix_cache(core)
    core.sleep.level, core.sleep.asleep = level, set(_TAGS)


def wake_up(core: "EngineCore", tags: list[str] | None = None) -> None:
    if not core.config.enable_sleep_mode:
        raise ValueError("Sleep mode is not enabled: create the engine with "
                         "enable_sleep_mode=True")
    tags = list(_TAGS) if tags is None else list(tags)
    unknown = [t for t in tags if t not in _TAGS]
    if unknown:
        raise ValueError(f"Unknown wake_up tags {unknown}; expected any of {list(_TAGS)}")
    core.executor.collective_rpc("wake_up", (tags,))
    if "weights" in tags and "weights" in core.sleep.asleep:
        core.sleep.weights_need_loading = core.sleep.level == 2
    core.sleep.asleep -= set(tags)


def update_weights(core: "EngineCore", update_info: dict) -> None:
    """One round of `update_weights` on every rank, then no stale KV block survives."""
    _require_idle(core, "update weights")
    core.executor.collective_rpc("update_weights", (update_info,))
    core.sleep.weights_need_loading = False
    _drop_prefix_cache(core)


def reload_weights(core: "EngineCore") -> None:
    _require_idle(core, "reload weights")
    core.executor.collective_rpc("reload_weights")
    core.sleep.weights_need_loading = False
    _drop_prefix_cache(core)


def _require_idle(core: "EngineCore", what: str) -> None:
    stats = core.get_stats()
    busy = stats.num_running + stats.num_waiting
    if busy or core.has_unfinished_requests():
        raise RuntimeError(f"Cannot {what} while {busy} request(s) are in flight: let them "
                           "finish or abort them first")


def _drop_prefix_cache(core: "EngineCore") -> None:
    if not core.reset_prefix_cache():
        raise RuntimeError("The prefix cache could not be reset: KV blocks are still in use")


# Worker methods that change the weights: through `collective_rpc` too, the engine
# does what `update_weights`/`reload_weights` above do around them.
_WEIGHT_CHANGES = ("update_weights", "reload_weights")


def collective_rpc(core: "EngineCore", method, args: tuple = (),
                   kwargs: dict | None = None) -> list:
    """`method` on every rank; sleep, wake_up and the weight changes by name keep the
    engine's side in step (idle check, prefix cache, sleep status)."""
    if method in ("sleep", "wake_up"):
        (sleep if method == "sleep" else wake_up)(core, *args, **(kwargs or {}))
        return [None] * core.config.world_size
    if method in _WEIGHT_CHANGES:
        _require_idle(core, method.replace("_", " "))
    results = core.executor.collective_rpc(method, tuple(args), kwargs)
    if method in _WEIGHT_CHANGES:
        core.sleep.weights_need_loading = False
        _drop_prefix_cache(core)
    return results

"""Sleep mode on a served replica (`--enable-sleep-mode`; vLLM's /sleep, /wake_up and
/is_sleeping, which the gateway fans out to every replica).

Each call runs on the engine thread between two steps (`EngineLoop.call_soon`), so
it never races a step, and goes through the engine's own `worker_control`: sleep is
refused while requests are in flight (the message says how many), drops the prefix
cache, and while anything sleeps every new request is refused (`EngineSleeping`:
`Generate` fails FAILED_PRECONDITION with `SLEEPING_MESSAGE`, which the gateway
answers 503, as vLLM does) -- never a hang.

Level 2 discards the weights; `wake_up` of the weights then reloads them from the
checkpoint this replica started from (vLLM leaves that to the caller's weight
update; a served replica has no other source), so after any wake_up that woke the
weights the replica serves the same model as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from pagoda.engine import worker_control
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.worker_control import EngineSleeping
from pagoda.services.common.protocol.scheduler import SLEEPING_MESSAGE
from pagoda.services.scheduler.engine_loop import EngineLoop

T = TypeVar("T")
__all__ = ["EngineSleeping", "SLEEPING_MESSAGE", "sleep", "wake_up", "sleep_state",
           "on_engine_thread"]


def sleep(core: EngineCore, level: int) -> None:
    """Engine thread only. ValueError (bad level, sleep mode off), RuntimeError (busy,
    already asleep)."""
    worker_control.sleep(core, level or 1)


def wake_up(core: EngineCore, tags: list[str] | None) -> bool:
    """Engine thread only. Wakes `tags` (None: all); weights woken from level 2 are
    reloaded from the checkpoint at once. Whether anything still sleeps."""
    worker_control.wake_up(core, tags)
    if core.sleep.weights_need_loading:
        worker_control.reload_weights(core)
    return core.sleep.is_sleeping


def sleep_state(core: EngineCore) -> tuple[bool, int, list[str]]:
    """(is_sleeping, level of the last sleep, tags asleep); a read of plain fields,
    safe from any thread (a stale answer at worst)."""
    status = core.sleep
    return status.is_sleeping, status.level, sorted(status.asleep)


async def on_engine_thread(engine: EngineLoop, fn: Callable[[], T],
                           timeout: float | None = None) -> T:
    """`fn()` run on the engine thread before its next step; its result, or its
    exception raised here."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result, error) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except Exception as exc:  # noqa: BLE001 - handed to the caller, the loop goes on
            result, error = None, exc
        loop.call_soon_threadsafe(settle, result, error)

    engine.call_soon(run)
    return await asyncio.wait_for(done, timeout)

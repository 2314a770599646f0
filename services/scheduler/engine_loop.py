"""The engine core's step loop, in its own thread.

gRPC handlers never touch the `EngineCore` (it is not thread-safe): they post
adds and aborts to this loop's inbox and get outputs back through callbacks, once
per step for all requests. So a step that takes 100 ms never blocks a handler,
and a handler never blocks a step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagoda.core.kv_events import KVEvent
from pagoda.engine.core_types import EngineCoreOutput, EngineCoreRequest
from pagoda.engine.engine_core import EngineCore
from pagoda.metrics.recorder import EngineStatsRecorder

logger = logging.getLogger(__name__)

# Called from the engine thread; must be quick and thread-safe.
AcceptCallback = Callable[[Exception | None], None]
OutputsCallback = Callable[[list[EngineCoreOutput]], None]
KvEventsCallback = Callable[[list[KVEvent]], None]
FailureCallback = Callable[[Exception], None]


@dataclass
class _Add:
    request: EngineCoreRequest
    on_accept: AcceptCallback


class EngineLoop:
    """Invariant: every `submit` gets exactly one `on_accept` call (None or the
    ValueError that rejected it); after a failure every later submit is rejected
    with the failure."""

    def __init__(self, core: EngineCore, on_outputs: OutputsCallback,
                 on_kv_events: KvEventsCallback, on_failure: FailureCallback,
                 recorder: EngineStatsRecorder | None = None) -> None:
        self.core = core
        self._recorder = recorder  # metrics: told of every accepted add and every step
        self._on_outputs = on_outputs
        self._on_kv_events = on_kv_events
        self._on_failure = on_failure
        self._cv = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._stopped = False
        self.failure: Exception | None = None
        self.stats = core.get_stats()  # refreshed every step; read by GetLoad
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: EngineCoreRequest, on_accept: AcceptCallback) -> None:
        with self._cv:
            if self.failure is not None:
                on_accept(self.failure)
                return
            self._adds.append(_Add(request, on_accept))
            self._cv.notify()

    def abort(self, request_ids: list[str]) -> None:
        with self._cv:
            self._aborts.extend(request_ids)
            self._cv.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._adds or self._aborts or self._stopped
                               or self.core.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stopped:
                        return
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                self._apply(adds, aborts)
                self._step()
        except Exception as exc:  # the worker died, or a bug: fail loudly, never hang
            logger.exception("engine loop failed")
            with self._cv:
                self.failure = exc
                pending, self._adds = self._adds, []
            for add in pending:
                add.on_accept(exc)
            self._on_failure(exc)

    def _apply(self, adds: list[_Add], aborts: list[str]) -> None:
        for add in adds:
            try:
                self.core.add_request(add.request)
            except ValueError as exc:
                add.on_accept(exc)
            else:
                if self._recorder is not None:
                    self._recorder.on_add(add.request)
                add.on_accept(None)
        if aborts:
            self.core.abort_requests(aborts)

    def _step(self) -> None:
        step_start = time.time()
        outputs = self.core.step()
        self.stats = self.core.get_stats()
        if self._recorder is not None:  # before dispatch: a finished request is counted
            self._recorder.on_step(self.core, step_start, outputs, self.stats)
        if outputs:
            self._on_outputs(outputs)
        events = self.core.take_kv_events()
        if events:
            self._on_kv_events(events)

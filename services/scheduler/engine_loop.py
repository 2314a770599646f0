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
from pagoda.messages import EngineCoreOutput, EngineCoreRequest
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.worker_control import EngineSleeping
from pagoda.metrics.recorder import EngineStatsRecorder
from pagoda.services.common.thread_names import ENGINE_LOOP, name_this_thread

logger = logging.getLogger(__name__)

# Called from the engine thread; must be quick and thread-safe.
AcceptCallback = Callable[[Exception | None], None]
OutputsCallback = Callable[[list[EngineCoreOutput]], None]
KvEventsCallback = Callable[[list[KVEvent]], None]
FailureCallback = Callable[[Exception], None]
RequestFailedCallback = Callable[[str, str, bool], None]  # (id, why, the request's fault)


class QueueFull(Exception):
    """The waiting queue holds `--max-waiting-requests` requests: come back later."""


@dataclass
class _Add:
    request: EngineCoreRequest
    on_accept: AcceptCallback


class EngineLoop:
    """Invariant: every `submit` gets exactly one `on_accept` call (None, the
    ValueError that rejected it, EngineSleeping while the engine sleeps, or QueueFull); after a failure every later submit
    is rejected with the failure.

    Back-pressure: with `max_waiting_requests` set, a submit is refused with
    QueueFull when the requests waiting in the scheduler plus those posted but not
    yet applied reach it, so memory stays bounded however fast requests arrive.
    """

    def __init__(self, core: EngineCore, on_outputs: OutputsCallback,
                 on_kv_events: KvEventsCallback, on_failure: FailureCallback,
                 recorder: EngineStatsRecorder | None = None,
                 on_request_failed: RequestFailedCallback | None = None) -> None:
        self.core = core
        # A request the worker refused (the rest of the replica goes on): told before
        # the step's outputs, which carry its ABORT.
        self._on_request_failed = on_request_failed
        self._recorder = recorder  # metrics: told of every accepted add and every step
        self._on_outputs = on_outputs
        self._on_kv_events = on_kv_events
        self._on_failure = on_failure
        self._cv = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._calls: list[Callable[[], None]] = []  # run on this thread between steps
        self._stopped = False
        self.failure: Exception | None = None
        self.stats = core.get_stats()  # refreshed every step; read by GetLoad
        self.max_waiting_requests = core.config.scheduler.max_waiting_requests
        # The scheduler's waiting queue as of the last apply/step (guarded by _cv):
        # exact after a step, and counts accepted adds until the next one.
        self._num_waiting = 0
        self._thread = threading.Thread(target=self._run, name=ENGINE_LOOP, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: EngineCoreRequest, on_accept: AcceptCallback) -> None:
        with self._cv:
            if self.failure is not None:
                on_accept(self.failure)
                return
            limit = self.max_waiting_requests
            if limit is not None and self._num_waiting + len(self._adds) >= limit:
                on_accept(QueueFull(f"The scheduler's waiting queue is full ({limit} requests "
                                    f"waiting); retry later."))
                return
            self._adds.append(_Add(request, on_accept))
            self._cv.notify()

    @property
    def num_waiting(self) -> int:
        """Requests waiting as admission counts them (what QueueFull compares with the
        limit): the scheduler's queue as of the last step plus the adds applied or posted
        since. GetLoad reports it, so a burst of adds the loop has not stepped yet (many
        requests arriving in one GenerateStream message) is never reported as idle."""
        with self._cv:
            return self._num_waiting + len(self._adds)

    def abort(self, request_ids: list[str]) -> None:
        with self._cv:
            self._aborts.extend(request_ids)
            self._cv.notify()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread before the next step (it may read the core)."""
        with self._cv:
            self._calls.append(fn)
            self._cv.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        name_this_thread(self._thread.name)  # its CPU shows apart in top -H and the bench
        try:
            while True:
                with self._cv:
                    while not (self._adds or self._aborts or self._calls or self._stopped
                               or self.core.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stopped:
                        return
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    calls, self._calls = self._calls, []
                self._apply(adds, aborts)
                for fn in calls:
                    fn()
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
        accepted = 0
        for add in adds:
            try:
                self.core.add_request(add.request)
            except (ValueError, EngineSleeping) as exc:  # refused: the loop goes on
                add.on_accept(exc)
            else:
                if self._recorder is not None:
                    self._recorder.on_add(add.request)
                accepted += 1
                add.on_accept(None)
        if aborts:
            self.core.abort_requests(aborts)
        with self._cv:
            self._num_waiting += accepted

    def _step(self) -> None:
        step_start = time.time()
        outputs = self.core.step()
        self.stats = self.core.get_stats()
        with self._cv:
            self._num_waiting = self.stats.num_waiting
        if self._recorder is not None:  # before dispatch: a finished request is counted
            self._recorder.on_step(self.core, step_start, outputs, self.stats)
        if self._on_request_failed is not None:
            for request_id, reason in self.core.take_rejected().items():
                self._on_request_failed(request_id, reason, False)
            for request_id, reason in self.core.take_invalid().items():
                self._on_request_failed(request_id, reason, True)
        if outputs:
            self._on_outputs(outputs)
        events = self.core.take_kv_events()
        if events:
            self._on_kv_events(events)

"""Fault injection for tests with real processes: named points that fail, stop short or
stall on demand. Inert unless the environment variable PAGODA_FAULT_INJECT is set.

    PAGODA_FAULT_INJECT=@/tmp/faults.json   the file is read at every hit of a point, so
                                            one running cluster takes fault after fault
    PAGODA_FAULT_INJECT='[{"point": ...}]'  fixed for the life of the process

The spec is a JSON list of faults (an empty file or list: none armed):

    {"point": "kv_pull.block",    one of POINTS
     "action": "fail",            "fail", "truncate" (the caller stops short) or "delay"
     "seconds": 3.0,              how long "delay" sleeps (in place, on the caller's thread)
     "after": 20,                 hits of the point let through first (default 0)
     "times": 1,                  hits it fires on, then it is spent (default 1; 0: always)
     "process": "kv_producer",    only in processes whose command line contains this
     "rank": 1}                   a context key of the point (WHERE): the caller's value
                                  must equal it; absent, any value matches

Hits are counted per process, only on calls whose context matches, from the moment the
spec's text changed (a fault may carry other keys, such as a serial number that makes an
identical spec armed again new). A production process never sets the variable: `check`
then returns None after one truth test of a string read at import, and nothing else here
runs. A process reads the variable when it imports this module: set it before starting
the processes it is meant for (mp followers inherit their driver's environment; `@file`
re-arms running ones).

A worker-group rank that fails in its S-th step of the group's first life, once:
    {"point": "rank.step", "rank": 1, "generation": 0, "after": S-1}
... in its first step of every life (a crash loop): no "generation", "times": 0.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

logger = logging.getLogger(__name__)
ENV = "PAGODA_FAULT_INJECT"
ACTIONS = ("fail", "truncate", "delay")
# The named points, where they are, and what each action means there.
POINTS = {
    # gpu-worker PullBlocks (a KV source serving a pull), before the epoch check:
    # delay = time between the lease and the pull; fail = the pull refused UNAVAILABLE.
    "kv_pull.start": "source worker, a pull arrives",
    # gpu-worker PullBlocks, before each block is sent (hit i = the i-th block sent by
    # this process): fail = the stream breaks (UNAVAILABLE) after the blocks sent so far;
    # truncate = the stream ends cleanly, short; delay = the pull stalls there.
    "kv_pull.block": "source worker, one block about to be sent",
    # gpu-worker FetchBlocks (the pulling side, PagodaConnector), before it pulls:
    # delay = the call starts late (its thread pool was busy), its caller's clock running.
    "kv_fetch.start": "pulling worker, a fetch starts",
    # gpu-worker ExecuteModel, before the model runs: fail = the step fails midway (the
    # worker forgets its requests and renews its KV epoch; the scheduler recovers by
    # setting the KV cache up again: what a restarted worker looks like to a lease).
    "worker.step": "gpu-worker, a step about to run",
    # scheduler's grammar compile thread: fail = the compile raises.
    "grammar.compile": "scheduler, a structured-output constraint compiles",
    # RankWorker.execute_model (pagoda.worker.rank_worker), on every rank of a worker
    # group, before the step: fail = that rank raises InjectedFault (the group is rebuilt).
    "rank.step": "worker-group rank, a step about to run",
    # gpu-worker host KV tier (pagoda.worker.host_kv_tier), as each block of an onload
    # is verified: fail = the slot fails its checksum (as a corrupt or overwritten one:
    # the block is recomputed); delay = the onload stalls there.
    "kv_onload.block": "gpu-worker, a host-tier block about to be onloaded",
    # gpu-worker disk KV tier (pagoda.worker.disk_kv_tier), before a record is written:
    # fail = the write raises ENOSPC (a full disk; the block is then not on disk).
    "kv_disk.write": "gpu-worker, a KV block about to be written to the disk tier",
}
# The context keys each point's caller passes to `check`. A fault naming one fires only
# on calls with that value; a fault naming a context key its point lacks is refused.
WHERE = {"rank.step": ("rank", "generation")}
_CONTEXT_KEYS = {key for keys in WHERE.values() for key in keys}

_SPEC = os.environ.get(ENV, "")
_lock = threading.Lock()
_state: dict = {"key": None, "faults": [], "hits": []}


class InjectedFault(RuntimeError):
    """Raised by callers for a "fail" at a point that has no error of its own."""


def check(point: str, **where) -> str | None:
    """The action of the fault armed at `point` in this process that fires on this hit,
    after sleeping in place for a "delay" (which then returns "delay"); None when none
    fires (always, unless PAGODA_FAULT_INJECT is set). `where`: this call's context,
    exactly the keys WHERE lists for the point."""
    if not _SPEC:
        return None
    if point not in POINTS or set(where) != set(WHERE.get(point, ())):
        raise ValueError(f"unknown fault-injection point or context {point!r} {where}")
    fault = _fire(point, where)
    if fault is None:
        return None
    action = fault.get("action", "fail")
    logger.warning("fault injected at %s: %s", point, json.dumps(fault, sort_keys=True))
    if action == "delay":
        time.sleep(float(fault.get("seconds", 1.0)))
    return action


def _fire(point: str, where: dict) -> dict | None:
    with _lock:
        faults, hits = _current()
        for i, fault in enumerate(faults):
            if fault.get("point") != point or any(
                    key in fault and fault[key] != value for key, value in where.items()):
                continue
            hits[i] += 1
            after, times = int(fault.get("after", 0)), int(fault.get("times", 1))
            if hits[i] > after and (times == 0 or hits[i] <= after + times):
                return fault
    return None


def _current() -> tuple[list[dict], list[int]]:
    """The armed faults and their hit counts; parsed again (counts from zero) whenever
    the spec's text changed. A spec that does not parse arms nothing, loudly."""
    text = _SPEC
    if _SPEC.startswith("@"):
        try:
            with open(_SPEC[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError:
            text = ""  # no file yet: nothing armed
    if text != _state["key"]:
        faults = _parse(text)
        _state.update(key=text, faults=faults, hits=[0] * len(faults))
    return _state["faults"], _state["hits"]


def _parse(text: str) -> list[dict]:
    try:
        faults = json.loads(text) if text.strip() else []
        for fault in faults:
            point = fault.get("point")
            if (point not in POINTS or fault.get("action", "fail") not in ACTIONS
                    or _CONTEXT_KEYS & (set(fault) - set(WHERE.get(point, ())))
                    or not all(isinstance(fault.get(k, 0), int) for k in ("after", "times"))):
                raise ValueError(f"bad fault {fault!r}")
    except (ValueError, AttributeError) as exc:
        logger.error("%s: not a fault list (%s); no fault armed", ENV, exc)
        return []
    argv = " ".join(sys.argv)
    return [f for f in faults if f.get("process", "") in argv]

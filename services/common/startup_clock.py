"""A service's start-up, phase by phase, in one log line.

`mark(phase)` closes a phase: the wall-clock seconds since the previous mark (the first
one: since the process started, as the kernel recorded it, so the interpreter's own
start and every import before `main` count). `report(what)` logs

    start-up: imports 2.31 s, engine config 0.40 s, model load 1.21 s; serving 4.10 s
    after the process started

once per process, when the service serves. Operators read it in the logs, and
`pagoda bench startup` reads it from every service of a cluster to say where the time
to a ready cluster goes (`parse_report` is its reader: the two live here together so
that the format has one owner).

Invariant: phases are disjoint and in order, so they sum to the total up to the last
mark (the time after it, until `report`, is the phase named by `report`'s `what`).
"""

from __future__ import annotations

import logging
import os
import re
import time

logger = logging.getLogger(__name__)
PREFIX = "start-up: "
_REPORT_RE = re.compile(r"start-up: (?P<phases>.*); (?P<what>[\w -]+) (?P<total>[\d.]+) s "
                        r"after the process started")
_PHASE_RE = re.compile(r"(?P<name>[\w -]+?) (?P<seconds>[\d.]+) s$")


def process_start_time() -> float:
    """When this process started (seconds since the epoch), from /proc; where /proc
    cannot say (not Linux), when this module was first imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # Field 22 (starttime, clock ticks after boot) follows the command name,
            # which may hold spaces: count from the last ')'.
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()
_phases: list[tuple[str, float]] = []
_last: float | None = None
_reported = False


def mark(phase: str) -> None:
    """End `phase` now (its time: since the previous mark, or the process's start)."""
    global _last
    now = time.time()
    start = _last if _last is not None else process_start_time()
    _phases.append((phase, max(now - start, 0.0)))
    _last = now


def line(what: str = "serving") -> str:
    """The report's text: the phases so far and the total until now."""
    total = max(time.time() - process_start_time(), 0.0)
    phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in _phases) or "no phases"
    return f"{PREFIX}{phases}; {what} {total:.2f} s after the process started"


def report(what: str = "serving") -> None:
    """Log `line(what)`, once per process (a restarted server in the same process does
    not report again)."""
    global _reported
    if _reported:
        return
    _reported = True
    logger.info("%s", line(what))


def parse_report(line: str) -> tuple[dict[str, float], str, float] | None:
    """(phases, what, total seconds) of a `report` line anywhere in `line`, else None."""
    match = _REPORT_RE.search(line)
    if match is None:
        return None
    phases = {}
    for part in match["phases"].split(", "):
        if (found := _PHASE_RE.match(part.strip())) is not None:
            phases[found["name"]] = float(found["seconds"])
    return phases, match["what"], float(match["total"])

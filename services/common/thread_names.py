"""Native (OS) names for a service's busy threads.

Python's thread names live only inside the interpreter (before 3.14): `top -H`,
`ps -L`, /proc/PID/task/TID/comm and the CPU figures read from them call every thread
"python". Naming the few threads that do a service's work (the scheduler's engine loop,
its KV-event publisher) lets an operator, and `pagoda bench control-plane`, see which
one spends the process's CPU.

Invariant: only the calling thread's native name changes (Linux truncates it to 15
bytes); elsewhere, or where prctl is missing, nothing happens.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15  # <linux/prctl.h>
_MAX_BYTES = 15  # the kernel's TASK_COMM_LEN, less the terminating NUL

ENGINE_LOOP = "engine-loop"  # the scheduler's engine thread
KV_EVENTS = "kv-events"  # the scheduler's KV-event publisher
# The names given to one thread each. A thread started by a named thread inherits its
# native name (Linux copies it at creation): the gRPC call-completion thread that the
# engine loop's ExecuteModel calls start (again after each lull) is "engine-loop" too.
# Readers of these names tell the named thread (the oldest: the lowest thread id) from
# those it started.
ONE_THREAD_NAMES = (ENGINE_LOOP, KV_EVENTS)


def name_this_thread(name: str) -> None:
    """Give the calling thread `name` as its OS name (never call it on the main
    thread: that one's name is the process's)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_MAX_BYTES]), 0, 0, 0)
    except (OSError, AttributeError):  # no libc symbol: the name stays "python"
        pass

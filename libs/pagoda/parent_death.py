"""Children that die with their parent, started without running code between fork and exec.

`subprocess.Popen(..., preexec_fn=f)` makes CPython fork() the whole process and run
Python in the child before exec: `f`, and every `os.register_at_fork` handler (gRPC's
among them). In a process with other threads that is unsafe: a lock some other thread
held at the fork stays locked forever in the child, and gRPC's fork handlers abort the
child (-6; the parent then gets BrokenPipeError) when other threads are inside gRPC.
Without `preexec_fn`, CPython starts the child with vfork() + exec, which runs no
Python code in between. So Pagoda never passes `preexec_fn`; instead the child sets
its own parent-death signal as the first thing it does:

    parent                                 child
    Popen([..., str(os.getpid()), ...])    set_parent_death_signal(parent_pid)
                                             prctl(PR_SET_PDEATHSIG, sig)
                                             os.getppid() != parent_pid? -> parent already
                                             gone (we were re-parented): die now

The `getppid` check closes the race of a parent that dies before the `prctl`. Linux
sends the signal when the *thread* that started the child exits, not the process:
start children from a long-lived thread. A program that cannot call this itself (a
server binary) runs under `python -m pagoda.parent_death PARENT_PID SIGNAL PROGRAM
[ARG...]`, which sets the signal and execs the program; the setting survives exec.
Elsewhere than Linux there is no such signal, and children are only stopped by
their parent's explicit shutdown.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(parent_pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """In a child: receive `sig` when `parent_pid` (the process that started this one)
    dies; if it already has, act on `sig` now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
        os._exit(128 + int(sig))  # only reached if `sig` is handled or ignored here


def dying_with_this_process(argv: list[str], sig: signal.Signals = signal.SIGKILL) -> list[str]:
    """`argv` wrapped so that the program gets `sig` when the calling process dies.
    Build it in the process (and thread) that then starts it."""
    return [sys.executable, "-m", "pagoda.parent_death", str(os.getpid()), sig.name, *argv]


def _main(args: list[str]) -> None:
    if len(args) < 3:
        sys.exit("usage: python -m pagoda.parent_death PARENT_PID SIGNAL PROGRAM [ARG...]")
    parent_pid, sig, argv = int(args[0]), signal.Signals[args[1]], args[2:]
    set_parent_death_signal(parent_pid, sig)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    _main(sys.argv[1:])

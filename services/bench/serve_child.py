"""`pagoda serve` as a child process of a benchmark: started with the given flags,
waited for until it prints its URL, its services' processes found by name for
CPU accounting, stopped with SIGTERM (like Ctrl-C) and, if need be, killed.

Invariant: `stop` leaves no process of the cluster behind (SIGTERM, then SIGKILL
to whatever of the tree is still alive after `timeout`)."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil

from pagoda.free_ports import free_port
from pagoda.services.common.thread_names import ONE_THREAD_NAMES

CLI_MODULE = "pagoda.services.cli.main"
URL_RE = re.compile(r"Pagoda is serving .* at (https?://\S+/v1)")


class ServeChild:
    def __init__(self, flags: list[str], timeout: float = 600.0, verbose: bool = False) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", CLI_MODULE, "serve", *flags, "--host", "127.0.0.1",
               "--port", str(self.port)]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: collections.deque[str] = collections.deque(maxlen=200)
        # Every line with when it arrived (time.monotonic()), for start-up timelines.
        self._timed: list[tuple[float, str]] = []
        self.url: str | None = None
        self._up = threading.Event()
        self._verbose = verbose
        threading.Thread(target=self._read, daemon=True).start()
        self._up.wait(timeout)
        if self.url is None:
            self.stop()
            raise RuntimeError("pagoda serve did not come up:\n" + "".join(list(self.log)[-40:]))

    def _read(self) -> None:
        for line in self.process.stdout:
            self.log.append(line)
            if len(self._timed) < 10_000:  # a start-up's worth; a long run stops keeping
                self._timed.append((time.monotonic(), line))
            if self._verbose:
                sys.stderr.write(line)
            if self.url is None and (match := URL_RE.search(line)):
                self.url = match.group(1)
                self._up.set()
        self._up.set()  # exited: stop waiting

    def timed_log(self) -> list[tuple[float, str]]:
        """The first lines the cluster printed, each with its arrival (monotonic s)."""
        return list(self._timed)

    def service_processes(self) -> dict[str, list[psutil.Process]]:
        """kind (gateway, scheduler, gpu-worker, tokenizer, kv-cache-manager) -> the
        processes running it, a gateway's API-server children included; `redis` too."""
        found: dict[str, list[psutil.Process]] = collections.defaultdict(list)
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                cmdline = child.cmdline()
            except psutil.Error:
                continue
            if CLI_MODULE in cmdline:
                found[cmdline[cmdline.index(CLI_MODULE) + 1]].append(child)
            elif cmdline and "redis-server" in os.path.basename(cmdline[0]):
                found["redis"].append(child)
        return dict(found)

    def stop(self, timeout: float = 60.0) -> None:
        try:
            tree = [psutil.Process(self.process.pid),
                    *psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.Error:
            tree = []
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5.0
        for proc in tree:  # the cluster's own processes, by pid (never by name)
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except psutil.TimeoutExpired:
                proc.kill()
            except psutil.Error:
                pass


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU seconds of `processes` so far (0 for one that is gone)."""
    total = 0.0
    for proc in processes:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


ThreadSamples = dict[tuple[int, int], tuple[str, float]]


def thread_cpu_samples(processes: list[psutil.Process],
                       one_thread_names: tuple[str, ...] = ONE_THREAD_NAMES) -> ThreadSamples:
    """(pid, tid) -> (the name it counts under, its user + system CPU seconds so far) for
    `processes`' live threads. The name is the thread's native one
    (services/common/thread_names.py; an unnamed Python thread is "python", gRPC's own
    are "event_engine" and the like), except that of the threads sharing one of
    `one_thread_names`, only the oldest (the lowest id: the one given the name) counts
    under it; those it started, which inherited the name, count under "NAME's threads"."""
    ticks = os.sysconf("SC_CLK_TCK")
    samples: ThreadSamples = {}
    for proc in processes:
        task_dir = f"/proc/{proc.pid}/task"
        try:
            tids = sorted(os.listdir(task_dir), key=int)  # oldest first (ids grow until pid_max)
        except OSError:
            continue
        seen: set[str] = set()
        for tid in tids:
            try:
                with open(f"{task_dir}/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"{task_dir}/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # ended meanwhile
                continue
            key = name
            if name in one_thread_names:
                key = f"{name}'s threads" if name in seen else name
                seen.add(name)
            samples[(proc.pid, int(tid))] = (key, (int(fields[11]) + int(fields[12])) / ticks)
    return samples


def thread_cpu_seconds(processes: list[psutil.Process],
                       one_thread_names: tuple[str, ...] = ONE_THREAD_NAMES,
                       since: ThreadSamples | None = None) -> dict[str, float]:
    """CPU seconds of `processes`' live threads, summed by the name they count under
    (`thread_cpu_samples`); with `since` (earlier samples), only what each spent after
    them. Per thread, so never negative: a thread started since counts from 0, and a
    thread that ended since is not counted (its CPU left /proc with it; the process's
    total still has it)."""
    total: dict[str, float] = collections.defaultdict(float)
    for thread, (key, seconds) in thread_cpu_samples(processes, one_thread_names).items():
        before = (since or {}).get(thread)
        if before is not None and before[1] <= seconds:  # else a reused id: a new thread
            seconds -= before[1]
        total[key] += seconds
    return dict(total)

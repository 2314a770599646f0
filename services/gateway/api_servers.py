"""`pagoda gateway --api-server-count N` (vLLM's flag): N gateway processes on one port.

The parent binds the listening socket once and hands it to N API-server processes
(each a full gateway: its own gRPC channels to the tokenizers and schedulers, its own
event loop), as vLLM does, rather than N processes binding the port with SO_REUSEPORT:
  * one accept queue: a connection waiting to be accepted is taken by whichever API
    server is free next; with SO_REUSEPORT each process has its own queue, filled by a
    hash of the client's address, and a process that dies takes the connections
    queued on it down with it (reset before any request was read), and one that is
    busy keeps getting its share;
  * the port never closes while an API server restarts (the parent holds it), so a
    restart is invisible to clients that were not on the dead process;
  * no other process of the same user can join the port (SO_REUSEPORT allows that).

Invariants:
  * an API server that exits is restarted by the parent with the same socket,
    arguments and index, under `pagoda serve`'s rule (services/common/restart_policy.py:
    backoff, at most MAX_RESTARTS in RESTART_WINDOW_S, else a crash loop and the parent
    exits 1 so that its own supervisor sees it); each restart counts in
    `pagoda_service_restarts_total{service="gateway-api-server-K"}`;
  * only the connections of a dead API server fail: the kernel closes its sockets, so
    each of its clients sees a closed connection (a stream ends without
    `data: [DONE]`), never a hang;
  * metrics are summed over the API servers (observability/multiprocess.py); routing
    state each keeps is per process where that is correct and shared where it must
    be (shared_state.py says which);
  * the parent logs `api server K of N: pid P` at every start and, with
    `--api-server-pid-file`, writes {"parent": pid, "api_servers": {K: pid}} (the hook
    chaos tests use to find them); the children die with the parent.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from pagoda.parent_death import dying_with_this_process
from pagoda.services.common.restart_policy import RestartLedger, RestartPolicy
from pagoda.services.gateway.observability import multiprocess
from pagoda.services.gateway.shared_state import SHARED_DIR_ENV

logger = logging.getLogger(__name__)

FD_ENV = "PAGODA_API_SERVER_FD"  # set in a child: the listening socket it serves
INDEX_ENV = "PAGODA_API_SERVER_INDEX"  # and which of the N it is
MAX_RESTARTS, RESTART_WINDOW_S, RESTART_BACKOFF_S = 5, 60.0, 0.5  # `pagoda serve`'s defaults
BACKLOG = 2048  # vLLM's uvicorn backlog


def child_socket() -> tuple[socket.socket, int] | None:
    """In an API server: the inherited listening socket and this server's index; None
    in a gateway that binds its own port (one process, or the parent)."""
    fd = os.environ.get(FD_ENV)
    if fd is None:
        return None
    return socket.socket(fileno=int(fd)), int(os.environ.get(INDEX_ENV, "0"))


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a last run
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


class ApiServers:
    """The parent: N children sharing `sock`, restarted when they exit."""

    def __init__(self, count: int, sock: socket.socket, argv: list[str],
                 pid_file: str | None = None,
                 policy: RestartPolicy | None = None) -> None:
        self.count, self.sock, self.argv, self.pid_file = count, sock, argv, pid_file
        self.policy = policy or RestartPolicy(MAX_RESTARTS, RESTART_WINDOW_S,
                                              RESTART_BACKOFF_S)
        self.children: dict[int, subprocess.Popen | None] = dict.fromkeys(range(count))
        self.ledgers = {i: RestartLedger(self.policy) for i in range(count)}
        self.restart_at: dict[int, float] = {}
        self.stopping = threading.Event()
        self.workdir = tempfile.mkdtemp(prefix="pagoda-gateway-")
        multiprocess.prepare_directory(os.path.join(self.workdir, "metrics"))
        os.environ[SHARED_DIR_ENV] = os.path.join(self.workdir, "shared")
        os.makedirs(os.environ[SHARED_DIR_ENV])
        # lazy: created after prepare_directory, so its values go to the shared files
        from prometheus_client import Counter
        self.restarts = Counter("pagoda_service_restarts",
                                "Times a supervisor restarted a service after it exited.",
                                ["service"])
        for i in range(count):  # 0 from start-up: a rate() sees the first restart
            self.restarts.labels(self.name(i))

    def name(self, index: int) -> str:
        return f"gateway-api-server-{index}"

    def spawn(self, index: int) -> None:
        env = dict(os.environ, **{FD_ENV: str(self.sock.fileno()), INDEX_ENV: str(index)})
        child = subprocess.Popen(dying_with_this_process(self.argv, signal.SIGTERM),
                                 pass_fds=(self.sock.fileno(),), env=env,
                                 stdin=subprocess.DEVNULL,
                                 # Ctrl-C reaches the parent only, which then stops each
                                 # once (a second signal would make uvicorn cut streams).
                                 start_new_session=True)
        self.children[index] = child
        logger.info("api server %d of %d: pid %d", index, self.count, child.pid)
        self.write_pid_file()

    def write_pid_file(self) -> None:
        if not self.pid_file:
            return
        pids = {str(i): c.pid for i, c in self.children.items()
                if c is not None and c.poll() is None}
        tmp = f"{self.pid_file}.tmp"
        with open(tmp, "w") as f:
            json.dump({"parent": os.getpid(), "api_servers": pids}, f)
        os.replace(tmp, self.pid_file)  # readers never see half a file

    def run(self, stop_timeout: float = 60.0) -> int:
        """Serve until SIGTERM/SIGINT (0) or a crash loop (1)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        for index in range(self.count):
            self.spawn(index)
        code = 0
        while not self.stopping.wait(0.2):
            if not self.check(time.monotonic()):
                code = 1
                break
        self.stop(stop_timeout)
        return code

    def check(self, now: float) -> bool:
        """Restart what exited (after its backoff); False on a crash loop."""
        for index, child in self.children.items():
            if child is None or child.poll() is None or index in self.restart_at:
                continue
            multiprocess.mark_dead(child.pid)
            delay = self.ledgers[index].next_delay(now)
            if delay is None:
                logger.critical("api server %d (pid %d) exited with code %s: %d restarts "
                                "in %g s, a crash loop; stopping the gateway", index,
                                child.pid, child.returncode, self.ledgers[index].recent,
                                self.policy.window_s)
                return False
            logger.warning("api server %d (pid %d) exited with code %s: restarting it in "
                           "%g s", index, child.pid, child.returncode, delay)
            self.restart_at[index] = now + delay
            self.write_pid_file()
        for index, at in list(self.restart_at.items()):
            if now >= at:
                del self.restart_at[index]
                self.spawn(index)
                self.restarts.labels(self.name(index)).inc()
        return True

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM every API server (each lets its streams finish, up to
        --shutdown-grace-period), SIGKILL what is left at `timeout`."""
        live = [c for c in self.children.values() if c is not None and c.poll() is None]
        for child in live:
            child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in live:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.sock.close()
        if self.pid_file and os.path.exists(self.pid_file):
            os.remove(self.pid_file)
        _remove_tree(self.workdir)


def child_argv() -> list[str]:
    """This gateway's command line, for its API servers (the same flags: with
    FD_ENV set they serve the inherited socket instead of binding the port)."""
    return [sys.executable, *_module_argv()]


def _module_argv() -> list[str]:
    # `pagoda gateway ...` and `python -m pagoda.services.cli.main gateway ...` alike.
    args = sys.argv[1:]
    if args and args[0] == "gateway":
        return ["-m", "pagoda.services.cli.main", *args]
    return ["-m", "pagoda.services.gateway.server", *args]


def _remove_tree(path: str) -> None:
    import shutil  # lazy: only at exit

    shutil.rmtree(path, ignore_errors=True)

"""A private, local Ray head for a driver that finds no Ray cluster to join.

`ray.init()` without a cluster would start one by forking this (the driver's)
process with a `preexec_fn`: unsafe once the driver has gRPC or other threads (the
failure `pagoda.parent_death` describes). So the head runs as a child started
without one, `ray start --head --block`, and the driver joins it by address, which
forks nothing. The head and every process Ray starts for it die with the driver:
SIGTERM to the head (at `stop()`, or from its parent-death signal) makes Ray stop
its raylet, GCS and workers.

Its temp dir is its own, so it does not become "the latest cluster on this
machine" that another `ray.init()` would join. It runs with Ray's token
authentication (RAY_AUTH_MODE=token): a random token, in a file only this user can
read, which the driver presents (`auth_env`); a process on the machine without it
can neither submit work nor join.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagoda.free_ports import free_port
from pagoda.parent_death import dying_with_this_process

_STARTED = "Ray runtime started."


class PrivateRayHead:
    """Invariant: `address` reaches a running head between `start()` and `stop()`."""

    def __init__(self, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.address: str | None = None
        # What a process needs in its environment to join this head (token auth).
        self.auth_env: dict[str, str] = {}
        self.process: subprocess.Popen | None = None
        self._dir: str | None = None

    def start(self, timeout_s: float = 120.0) -> "PrivateRayHead":
        """Start the head; return once Ray says it runs, or raise with its log's tail."""
        self._dir = tempfile.mkdtemp(prefix="pagoda-ray-")
        port = free_port()
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                f"--port={port}", f"--temp-dir={self._dir}", "--include-dashboard=false",
                "--disable-usage-stats", *_own_ports()]
        argv += [f"--num-cpus={self.num_cpus}"] if self.num_cpus is not None else []
        argv += [f"--num-gpus={self.num_gpus}"] if self.num_gpus is not None else []
        log = Path(self._dir) / "head.log"
        token = Path(self._dir) / "auth_token"
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32))
        self.auth_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        # Stopping is the point of SIGTERM here: skip Ray's drain wait (up to 30 s).
        env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **self.auth_env}
        env.pop("RAY_AUTH_TOKEN", None)  # it would win over the file
        with open(log, "wb") as out:
            self.process = subprocess.Popen(dying_with_this_process(argv, signal.SIGTERM),
                                            stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout_s
        while _STARTED not in log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"a private Ray head did not start within {timeout_s:g} s:"
                                   f"\n{tail}")
            time.sleep(0.1)
        self.address = f"127.0.0.1:{port}"
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the head and everything Ray started for it; idempotent."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.address = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def join_with_token(auth_env: dict[str, str]) -> None:
    """Make this process present the head's token: its environment, and Ray's settings,
    which Ray read when it was imported (so they are read again, the way Ray's own
    `_enable_token_auth` does)."""
    # lazy: ray is optional (installed for --distributed-executor-backend ray only)
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ.update(auth_env)
    os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over the head's file
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _own_ports() -> list[str]:
    """Free ports for the head's servers whose Ray defaults are fixed numbers (the client
    server's 10001, the dashboard agent's 52365): two private heads on one machine (two
    `pagoda serve --tensor-parallel-size 2`, or tests run in parallel) would otherwise
    collide, and a raylet whose agent cannot bind exits ("The raylet exited immediately
    because one Ray agent failed"). From `free_port`, below the ephemeral range: a port
    from bind(0) could be taken, before the agent binds it, by any outgoing connection
    on the node's address (Ray's own start-up makes dozens)."""
    flags = ("--ray-client-server-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")
    return [f"{flag}={free_port()}" for flag in flags]

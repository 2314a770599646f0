"""A loopback HTTP server that serves test images and misbehaves on purpose.

Paths: /ok.png (a small PNG), /big.bin (larger than tests' byte caps), /garbage.png
(not an image), /slow.png (answers after `slow_seconds`), /redirect?to=URL (302),
/flaky.png (HTTP 503 once, then the image), /missing (404). `hits` counts GETs per path.
"""

from __future__ import annotations

import io
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from PIL import Image


def png_bytes(size: tuple[int, int] = (16, 12), color: tuple[int, int, int] = (200, 30, 60)
              ) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


class MediaServer:
    """Start with `with MediaServer() as server:`; `server.url(path)` names a resource."""

    def __init__(self, slow_seconds: float = 3.0, bind: str = "127.0.0.1", port: int = 0) -> None:
        self.slow_seconds = slow_seconds
        self.hits: Counter[str] = Counter()
        self.images = {"/ok.png": png_bytes(), "/other.png": png_bytes(color=(10, 200, 10))}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                parts = urlsplit(self.path)
                server.hits[parts.path] += 1
                server.handle(self, parts.path, parse_qs(parts.query))

        self._httpd = ThreadingHTTPServer((bind, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def handle(self, h: BaseHTTPRequestHandler, path: str, query: dict) -> None:
        if path in self.images:
            return self._send(h, 200, self.images[path])
        if path == "/big.bin":
            return self._send(h, 200, b"\0" * 300_000)
        if path == "/garbage.png":
            return self._send(h, 200, b"this is not an image at all" * 10)
        if path == "/slow.png":
            time.sleep(self.slow_seconds)
            return self._send(h, 200, self.images["/ok.png"])
        if path == "/flaky.png":
            if self.hits[path] == 1:
                return self._send(h, 503, b"busy")
            return self._send(h, 200, self.images["/ok.png"])
        if path == "/redirect":
            h.send_response(302)
            h.send_header("Location", query["to"][0])
            h.send_header("Content-Length", "0")
            h.end_headers()
            return None
        return self._send(h, 404, b"no such thing")

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        try:
            h.send_response(status)
            h.send_header("Content-Type", "image/png")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout, size cap): nothing to do

    def __enter__(self) -> MediaServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

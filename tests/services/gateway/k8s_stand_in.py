"""A stand-in for the part of the Kubernetes API server that EndpointSlice discovery uses.

No API server runs in the tests. This one serves, for one namespace, exactly the two
requests the official client makes: the list
    GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=kubernetes.io/service-name=SVC
and the same with `watch=true`, which streams JSON lines `{"type", "object"}` until
`timeoutSeconds` or until the test drops the connection; like the real server it first
replays the events after the request's `resourceVersion`. Objects carry the fields the
real API requires (addressType, endpoints, metadata.resourceVersion). `kubeconfig()`
writes a kubeconfig pointing at it, for $KUBECONFIG.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

SERVICE_LABEL = "kubernetes.io/service-name"
_CLOSE = object()  # ends one watch stream


def endpoint(address: str, ready: bool = True, serving: bool | None = None,
             terminating: bool = False) -> dict:
    """An endpoint as the EndpointSlice controller writes it (serving defaults to ready)."""
    return {"addresses": [address],
            "conditions": {"ready": ready, "serving": ready if serving is None else serving,
                           "terminating": terminating}}


class KubeAPIStandIn:
    """EndpointSlices of one namespace, served over HTTP on loopback."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.slices: dict[str, dict] = {}
        self.version = 100
        self.num_lists = 0
        self.num_watches = 0
        self._watches: list[tuple[str, queue.Queue]] = []  # (service, events)
        self._history: list[tuple[int, str, dict]] = []  # (version, service, event)
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    # ------------------------------------------------------------- test controls
    def set_slice(self, name: str, service: str, endpoints: list[dict], port: int,
                  notify: bool = True) -> None:
        """Create or replace a slice; `notify=False` changes it without a watch event
        (as if it happened while the client was disconnected)."""
        with self._lock:
            kind = "MODIFIED" if name in self.slices else "ADDED"
            self.version += 1
            self.slices[name] = {
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": name, "namespace": self.namespace,
                             "resourceVersion": str(self.version),
                             "labels": {SERVICE_LABEL: service}},
                "addressType": "IPv4", "endpoints": endpoints,
                "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}]}
            if notify:
                self._send(service, {"type": kind, "object": self.slices[name]})

    def delete_slice(self, name: str, notify: bool = True) -> None:
        with self._lock:
            self.version += 1
            obj = self.slices.pop(name)
            obj["metadata"]["resourceVersion"] = str(self.version)
            if notify:
                self._send(obj["metadata"]["labels"][SERVICE_LABEL],
                           {"type": "DELETED", "object": obj})

    def expire_watches(self) -> None:
        """Send 410 Gone on every open watch (its resourceVersion is too old)."""
        with self._lock:
            for service, _ in self._watches:
                self._send(service, {"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "Expired", "code": 410,
                    "message": "too old resource version"}})

    def drop_watches(self) -> None:
        """End every open watch stream."""
        with self._lock:
            for _, events in self._watches:
                events.put(_CLOSE)

    def kubeconfig(self, folder: Path) -> Path:
        path = folder / "kubeconfig.json"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "users": [{"name": "gateway", "user": {"token": "stand-in"}}],
            "contexts": [{"name": "stand-in", "context": {
                "cluster": "stand-in", "user": "gateway", "namespace": self.namespace}}]}))
        return path

    def close(self) -> None:
        self.drop_watches()
        self._httpd.shutdown()
        self._httpd.server_close()

    # ------------------------------------------------------------------ serving
    def _send(self, service: str, event: dict) -> None:
        if event["type"] != "ERROR":
            self._history.append((self.version, service, event))
        for watched, events in self._watches:
            if watched == service:
                events.put(json.loads(json.dumps(event)))

    def _list(self, service: str) -> dict:
        with self._lock:
            self.num_lists += 1
            return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": [s for s in self.slices.values()
                              if s["metadata"]["labels"][SERVICE_LABEL] == service]}

    def _handler(self):
        stand_in = self
        prefix = f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # watch bodies are chunked, as the real server's

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                selector = query.get("labelSelector", "")
                if url.path != prefix or not selector.startswith(f"{SERVICE_LABEL}="):
                    self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                    return
                service = selector.split("=", 1)[1]
                if query.get("watch", "").lower() == "true":
                    self._watch(service, int(query.get("resourceVersion") or 0),
                                float(query.get("timeoutSeconds", 60)))
                else:
                    self._reply(200, stand_in._list(service))

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _watch(self, service: str, since: int, timeout_s: float) -> None:
                events: queue.Queue = queue.Queue()
                with stand_in._lock:
                    stand_in.num_watches += 1
                    for version, watched, event in stand_in._history:
                        if version > since and watched == service:
                            events.put(json.loads(json.dumps(event)))
                    stand_in._watches.append((service, events))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                deadline = time.monotonic() + timeout_s
                try:
                    while (left := deadline - time.monotonic()) > 0:
                        try:
                            event = events.get(timeout=min(left, 0.5))
                        except queue.Empty:
                            continue
                        if event is _CLOSE:
                            break
                        self._chunk(json.dumps(event).encode() + b"\n")
                    self._chunk(b"")  # the last chunk: this watch is over
                except OSError:
                    pass  # the client went away
                finally:
                    with stand_in._lock:
                        stand_in._watches.remove((service, events))

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def log_message(self, *args) -> None:
                pass

        return Handler

"""Scheduler replicas from the Kubernetes API: the EndpointSlices of one Service.

`k8s://NAMESPACE/SERVICE:PORT` in `--scheduler-addrs`. A thread lists the Service's
EndpointSlices (label `kubernetes.io/service-name=SERVICE`) with the official client,
then watches them from the list's resourceVersion. An endpoint is a replica while its
conditions say it serves: `ready` not false, `serving` not false, `terminating` not
true. Kubernetes sets these the moment a pod is marked for deletion, before its preStop
hook runs, so the gateway stops sending it new requests then, not when a DNS answer
ages out; a pod that turns Ready is a replica as soon as the event arrives.

Invariants:
- until the first list succeeds `addresses()` is None; once an attempt has failed
  (not in a cluster, no kubeconfig, no RBAC grant, API down) `unavailable` is True
  too, and the caller falls back to DNS;
- afterwards a broken or expired watch keeps the last known endpoints while it
  reconnects (list again, then watch), as a DNS hiccup keeps the last answer.

Credentials: the pod's service account (in-cluster config), else a kubeconfig
($KUBECONFIG or ~/.kube/config). The chart grants get/list/watch on endpointslices only.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 60  # the server ends each watch after this; we list again
READ_TIMEOUT_S = WATCH_TIMEOUT_S + 30  # a watch silent this long is dead
LIST_TIMEOUT_S = 10
MAX_BACKOFF_S = 5.0


def serving_addresses(endpoint_slice) -> list[str]:
    """The addresses of a V1EndpointSlice's endpoints whose conditions say they serve."""
    out = []
    for endpoint in endpoint_slice.endpoints or []:
        c = endpoint.conditions
        # Unset conditions mean "serving" (the API's documented default).
        if c is not None and (c.ready is False or c.serving is False or c.terminating is True):
            continue
        out += endpoint.addresses or []
    return out


def load_api_client():
    """A kubernetes ApiClient: in-cluster service account, else kubeconfig. Raises
    when neither is available."""
    from kubernetes import client, config  # lazy: kubernetes is optional (k8s:// only)

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        # $KUBECONFIG read now: the client's own default was read when it was imported.
        config.load_kube_config(os.environ.get("KUBECONFIG"),
                                client_configuration=configuration)
    configuration.retries = 0  # our loop retries, with backoff and one log line
    return client.ApiClient(configuration)


class EndpointSliceWatch:
    """The serving endpoints (pod IPs) of one Service, kept current by a daemon thread.
    `on_change()` is called (from that thread) whenever the set of addresses changes."""

    def __init__(self, namespace: str, service: str,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.namespace = namespace
        self.service = service
        self.on_change = on_change
        self._lock = threading.Lock()
        self._slices: dict[str, list[str]] | None = None  # None: never listed
        self.unavailable = False  # an attempt to reach the API failed before any list
        self._stop = threading.Event()
        self._watch = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"k8s-watch-{service}")

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.service}"

    def start(self) -> "EndpointSliceWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def addresses(self) -> list[str] | None:
        """Every serving endpoint (sorted), or None before the first successful list."""
        with self._lock:
            if self._slices is None:
                return None
            return sorted({a for found in self._slices.values() for a in found})

    def _run(self) -> None:
        try:
            from kubernetes import client  # lazy: kubernetes is optional (k8s:// only)

            api = client.DiscoveryV1Api(load_api_client())
        except Exception as exc:  # no in-cluster config and no kubeconfig
            logger.warning("k8s://%s: no Kubernetes API credentials (%s); finding replicas "
                           "through DNS instead", self.name, exc)
            self._fail()
            return
        backoff, failing = 0.2, False
        while not self._stop.is_set():
            try:
                version = self._list(api)
                if failing:
                    logger.info("k8s://%s: the Kubernetes API answers again", self.name)
                backoff, failing = 0.2, False
                self._follow(api, version)
            except Exception as exc:  # ApiException, connection errors, a dead stream
                if self._stop.is_set():
                    return
                if getattr(exc, "status", None) == 410:  # the watch's version expired
                    continue  # list again at once: routine, not a failure
                if not failing:
                    logger.warning("k8s://%s: %s (keeping %s; retrying)", self.name,
                                   _describe(exc), "the last known endpoints"
                                   if self._slices is not None else "DNS meanwhile")
                failing = True
                if self._slices is None:
                    self._fail()
                backoff = min(backoff * 2, MAX_BACKOFF_S)
            self._stop.wait(backoff)

    def _fail(self) -> None:
        if not self.unavailable:
            self.unavailable = True
            self.on_change()  # the caller may fall back to DNS now

    def _selector(self) -> str:
        return f"kubernetes.io/service-name={self.service}"

    def _list(self, api) -> str:
        reply = api.list_namespaced_endpoint_slice(self.namespace, label_selector=self._selector(),
                                                   _request_timeout=LIST_TIMEOUT_S)
        self._update({s.metadata.name: serving_addresses(s) for s in reply.items})
        return reply.metadata.resource_version

    def _follow(self, api, version: str) -> None:
        """Apply watch events until the server ends the watch (then list again)."""
        from kubernetes import watch  # lazy: kubernetes is optional (k8s:// only)

        self._watch = watch.Watch()
        if self._stop.is_set():  # stop() ran before this watch existed
            return
        for event in self._watch.stream(
                api.list_namespaced_endpoint_slice, self.namespace,
                label_selector=self._selector(), resource_version=version,
                timeout_seconds=WATCH_TIMEOUT_S, allow_watch_bookmarks=True,
                _request_timeout=(LIST_TIMEOUT_S, READ_TIMEOUT_S)):
            kind, obj = event["type"], event["object"]
            if kind not in ("ADDED", "MODIFIED", "DELETED"):
                continue  # BOOKMARK: nothing changed
            slices = dict(self._slices or {})
            if kind == "DELETED":
                slices.pop(obj.metadata.name, None)
            else:
                slices[obj.metadata.name] = serving_addresses(obj)
            self._update(slices)

    def _update(self, slices: dict[str, list[str]]) -> None:
        before = self.addresses()
        with self._lock:
            self._slices = slices
        after = self.addresses()
        if after != before:
            logger.info("k8s://%s serves at %s", self.name, ", ".join(after) or "nothing")
            self.on_change()


def _describe(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    if status is not None:  # kubernetes.client.ApiException
        return f"the Kubernetes API answered {status} {getattr(exc, 'reason', '')}".strip()
    return f"{type(exc).__name__}: {exc}"

"""Where the scheduler replicas are: `--scheduler-addrs` as given, from DNS, or from
the Kubernetes API.

`--scheduler-addrs` is a comma-separated list whose items are
- `host:port`: one replica, used as is;
- `dns:///name:port`: every A/AAAA record of `name` is a replica, re-resolved every
  `DNS_REFRESH_S` seconds (a Kubernetes headless Service lists its Ready pods, so
  replicas join and leave with their readiness, as fast as DNS caches allow).
  `dns://authority/name:port` is accepted too; the authority is ignored;
- `k8s://namespace/service:port`: every serving endpoint of the Service's
  EndpointSlices, watched through the Kubernetes API (discovery_k8s.py): a pod
  marked for deletion stops getting requests at once. Until the API has answered,
  the Service's DNS name `service.namespace.svc` stands in.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pagoda.services.gateway.routing.discovery_k8s import EndpointSliceWatch

logger = logging.getLogger(__name__)
DNS_REFRESH_S = 5.0
# (host, port) -> getaddrinfo-style records; injectable for tests.
Resolver = Callable[[str, int], Awaitable[list[tuple]]]


@dataclass(frozen=True)
class Target:
    """One item of `--scheduler-addrs`."""

    host: str  # the Service's name for a k8s target
    port: int
    dns: bool  # resolve to every address (else: one replica at host:port)
    k8s_namespace: str | None = None  # set: watch the Service's EndpointSlices

    @property
    def is_k8s(self) -> bool:
        return self.k8s_namespace is not None

    @property
    def dns_name(self) -> str:
        """The name DNS answers for (a k8s target: the Service's in-cluster name)."""
        return f"{self.host}.{self.k8s_namespace}.svc" if self.is_k8s else self.host

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)


def parse_scheduler_addrs(text: str | list[str]) -> list[Target]:
    """Raises ValueError for an item without a port."""
    items = text.split(",") if isinstance(text, str) else text
    targets = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        if item.startswith("k8s://"):
            targets.append(_parse_k8s(item))
            continue
        dns = item.startswith("dns:")
        if dns:
            item = item[4:].lstrip("/")
            if "/" in item:  # dns://authority/name:port
                item = item.split("/", 1)[1]
        host, port = split_host_port(item)
        targets.append(Target(host, port, dns))
    if not targets:
        raise ValueError("at least one scheduler address is required")
    return targets


def _parse_k8s(item: str) -> Target:
    namespace, sep, rest = item[len("k8s://"):].partition("/")
    if not sep or not namespace or "/" in rest:
        raise ValueError(f"scheduler address {item!r} is not k8s://NAMESPACE/SERVICE:PORT")
    service, port = split_host_port(rest)
    return Target(service, port, False, namespace)


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"scheduler address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def system_resolver(host: str, port: int) -> list[tuple]:
    return await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)


class Discovery:
    """The current replica addresses. Invariant: a name that fails to resolve, or a
    Kubernetes watch that breaks, keeps its last known addresses (a hiccup must not
    empty the cluster). Create inside the event loop that calls it."""

    def __init__(self, targets: list[Target], resolver: Resolver = system_resolver,
                 refresh_s: float = DNS_REFRESH_S, watch_factory=None) -> None:
        self.targets = targets
        self.resolver = resolver
        self.refresh_s = refresh_s
        self._resolved: dict[Target, list[str]] = {}
        self._next_refresh = 0.0
        self._watch_factory = watch_factory  # (namespace, service, on_change) -> watch
        self._watches: dict[Target, object] = {}
        self._changed: asyncio.Event | None = None

    @property
    def is_dynamic(self) -> bool:
        """Whether the addresses can change (DNS names or Kubernetes Services)."""
        return any(t.dns or t.is_k8s for t in self.targets)

    def static_addresses(self) -> list[str]:
        return [t.address for t in self.targets if not (t.dns or t.is_k8s)]

    async def addresses(self, now: float) -> list[str]:
        """Every replica address, re-resolving DNS names when they are due."""
        self._start_watches()
        names = [t for t in self.targets if t.dns or self._falls_back(t)]
        if now >= self._next_refresh:
            self._next_refresh = now + self.refresh_s
        else:  # only a fallback that just began cannot wait for its turn
            names = [t for t in names if t not in self._resolved]
        await asyncio.gather(*(self._resolve(t) for t in names))
        out: list[str] = []
        for target in self.targets:
            for address in self._addresses_of(target):
                if address not in out:
                    out.append(address)
        return out

    def _addresses_of(self, target: Target) -> list[str]:
        if target.is_k8s:
            watched = self._watches[target].addresses()
            if watched is not None:
                return [join_host_port(ip, target.port) for ip in watched]
            return self._resolved.get(target, [])  # empty until the watch has tried
        return self._resolved.get(target, []) if target.dns else [target.address]

    def _falls_back(self, target: Target) -> bool:
        """A k8s target whose watch could not reach the API before its first list."""
        watch = self._watches.get(target) if target.is_k8s else None
        return watch is not None and watch.addresses() is None and watch.unavailable

    async def wait_changed(self, timeout: float) -> None:
        """Sleep `timeout` seconds, or less if a Kubernetes watch saw a change."""
        changed = self._event()
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        changed.clear()

    def close(self) -> None:
        for watch in self._watches.values():
            watch.stop()

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _start_watches(self) -> None:
        pending = [t for t in self.targets if t.is_k8s and t not in self._watches]
        if not pending:
            return
        loop, changed = asyncio.get_running_loop(), self._event()

        def on_change() -> None:  # from the watch's thread
            try:
                loop.call_soon_threadsafe(changed.set)
            except RuntimeError:  # the loop has closed: nobody is waiting
                pass

        if self._watch_factory is None:
            self._watch_factory = EndpointSliceWatch
        for target in pending:
            watch = self._watch_factory(target.k8s_namespace, target.host, on_change)
            self._watches[target] = watch.start()

    async def _resolve(self, target: Target) -> None:
        name = target.dns_name
        try:
            records = await self.resolver(name, target.port)
        except OSError as exc:
            logger.warning("cannot resolve %s: %s (keeping %d known replicas)", name, exc,
                           len(self._resolved.get(target, [])))
            self._resolved.setdefault(target, [])  # tried: wait for the next refresh
            return
        found = sorted({join_host_port(r[4][0], target.port) for r in records})
        if found != self._resolved.get(target):
            logger.info("%s resolves to %s", name, ", ".join(found) or "nothing")
        self._resolved[target] = found

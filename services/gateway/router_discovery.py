"""Where the scheduler replicas are: `--scheduler-addrs` as given, or from DNS.

`--scheduler-addrs` is a comma-separated list whose items are either `host:port`
(one replica, used as is) or `dns:///name:port` (every A/AAAA record of `name`
is a replica, re-resolved every `DNS_REFRESH_S` seconds: a Kubernetes headless
Service lists exactly its Ready pods, so replicas join and leave with their
readiness). `dns://authority/name:port` is accepted too; the authority is
ignored (the system resolver answers).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)
DNS_REFRESH_S = 5.0
# (host, port) -> getaddrinfo-style records; injectable for tests.
Resolver = Callable[[str, int], Awaitable[list[tuple]]]


@dataclass(frozen=True)
class Target:
    """One item of `--scheduler-addrs`."""

    host: str
    port: int
    dns: bool  # resolve to every address (else: one replica at host:port)

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
    """The current replica addresses. Invariant: a name that fails to resolve keeps
    its last known addresses (a DNS hiccup must not empty the cluster)."""

    def __init__(self, targets: list[Target], resolver: Resolver = system_resolver,
                 refresh_s: float = DNS_REFRESH_S) -> None:
        self.targets = targets
        self.resolver = resolver
        self.refresh_s = refresh_s
        self._resolved: dict[Target, list[str]] = {}
        self._next_refresh = 0.0

    @property
    def has_dns(self) -> bool:
        return any(t.dns for t in self.targets)

    def static_addresses(self) -> list[str]:
        return [t.address for t in self.targets if not t.dns]

    async def addresses(self, now: float) -> list[str]:
        """Every replica address, re-resolving DNS names when they are due."""
        if self.has_dns and now >= self._next_refresh:
            self._next_refresh = now + self.refresh_s
            await asyncio.gather(*(self._resolve(t) for t in self.targets if t.dns))
        out: list[str] = []
        for target in self.targets:
            for address in (self._resolved.get(target, []) if target.dns else [target.address]):
                if address not in out:
                    out.append(address)
        return out

    async def _resolve(self, target: Target) -> None:
        try:
            records = await self.resolver(target.host, target.port)
        except OSError as exc:
            logger.warning("cannot resolve %s: %s (keeping %d known replicas)", target.host, exc,
                           len(self._resolved.get(target, [])))
            return
        found = sorted({join_host_port(r[4][0], target.port) for r in records})
        if found != self._resolved.get(target):
            logger.info("%s resolves to %s", target.host, ", ".join(found) or "nothing")
        self._resolved[target] = found

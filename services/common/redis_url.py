"""How a process is told where its Redis is and how to log in, without a secret in argv.

The URL comes from `--redis-url` or, when the URL itself carries a password, from the
PAGODA_REDIS_URL environment variable; a password alone comes from REDIS_PASSWORD. Both
reach the process through its environment (a Kubernetes secretKeyRef, or `pagoda serve`
setting its child's environment), so neither shows in `ps` or /proc/PID/cmdline, and
`redact` keeps them out of log lines.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

import redis

REDIS_URL_ENV = "PAGODA_REDIS_URL"
REDIS_PASSWORD_ENV = "REDIS_PASSWORD"


def default_redis_url(fallback: str) -> str:
    """The default of a `--redis-url` flag: $PAGODA_REDIS_URL, else `fallback`."""
    return os.environ.get(REDIS_URL_ENV) or fallback


def connect(url: str, **kwargs) -> redis.Redis:
    """A client for `url`, logging in with $REDIS_PASSWORD unless the URL has a password."""
    password = os.environ.get(REDIS_PASSWORD_ENV)
    if password and not urlsplit(url).password:
        kwargs.setdefault("password", password)
    return redis.Redis.from_url(url, **kwargs)


def redact(url: str) -> str:
    """`url` with any password replaced by ***, for log lines and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

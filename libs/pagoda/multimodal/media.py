"""Load images named by URL: `data:` (base64), `http(s)://` (fetched) and `file://`.

Fetching a URL a client sent is server-side request forgery waiting to happen: the
server would GET whatever the client names, inside the operator's network. The rules:

* `http(s)` only to hosts the operator allows. With `allowed_media_domains` set, only
  those host names (exact, case-insensitive); a listed host may resolve to a private
  address (the operator named it). Without a list, any host whose every resolved
  address is public: loopback, private, link-local (cloud metadata at 169.254.169.254),
  multicast, reserved and unspecified addresses are refused. The connection then goes to
  an address that check vetted (the URL's host stays in the Host header and the TLS
  server name), never to a second lookup: a name that re-resolves to an inner address
  between the check and the connect (DNS rebinding) cannot steer the GET there. The
  peer's address is checked again before the body is read.
* Redirects are followed by hand, at most `MAX_REDIRECTS`, each hop checked by the
  same rules; a redirect to a refused host fails the request.
* `file://` only for paths (symlinks resolved) under `allowed_local_media_path`.
* Every item is capped in bytes (checked while streaming, never after buffering it all)
  and every image in pixels from its header, before decoding: a decompression bomb is
  refused without being decoded.
* One fetch, its redirects and its body together take at most `timeout` seconds.

Each failure is its own `MediaError` subclass (a ValueError: the request's fault, a 400
wherever it surfaces), with a message that names the URL's host, never its contents.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ipaddress
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import httpx
from PIL import Image

import pagoda.envs as envs  # the module, not the package: `pagoda` imports LLM, which loads media

MAX_REDIRECTS = 5
_CHUNK = 64 * 1024


class MediaError(ValueError):
    """A media item could not be loaded because of the request (HTTP 400)."""

    code = "invalid_media"


class MediaDecodeError(MediaError):
    """The bytes are not an image Pillow can decode (or a data: URL is not base64)."""

    code = "media_undecodable"


class MediaTooLargeError(MediaError):
    """The item has more bytes than allowed."""

    code = "media_too_large"


class ImageTooManyPixelsError(MediaError):
    """The image's header declares more pixels than allowed (decompression bomb)."""

    code = "image_too_many_pixels"


class MediaDomainNotAllowedError(MediaError):
    """The URL's host is not allowed (allow-list, or a private address without one)."""

    code = "media_domain_not_allowed"


class MediaRedirectNotAllowedError(MediaDomainNotAllowedError):
    """A redirect pointed at a host the rules refuse (or there were too many)."""

    code = "media_redirect_not_allowed"


class MediaFetchTimeoutError(MediaError):
    """The fetch did not finish within the timeout."""

    code = "media_fetch_timeout"


class MediaFetchError(MediaError):
    """The server answered with an error status, or the connection failed."""

    code = "media_fetch_failed"


class LocalMediaPathError(MediaError):
    """A file:// URL outside --allowed-local-media-path (or none is allowed)."""

    code = "local_media_path_not_allowed"


class UnsupportedMediaURLError(MediaError):
    """A URL scheme other than data, http, https and file."""

    code = "media_url_unsupported"


@dataclass(frozen=True)
class MediaLimits:
    """Operator settings for loading media; defaults from the environment (`envs`)."""

    allowed_media_domains: frozenset[str] | None = None
    allowed_local_media_path: str | None = None
    timeout: float = field(default_factory=lambda: envs.get("PAGODA_IMAGE_FETCH_TIMEOUT"))
    max_retries: int = field(default_factory=lambda: envs.get("PAGODA_MEDIA_FETCH_MAX_RETRIES"))
    cache_dir: str | None = field(default_factory=lambda: envs.get("PAGODA_MEDIA_CACHE"))
    max_bytes: int = field(default_factory=lambda: envs.get("PAGODA_MEDIA_MAX_BYTES"))
    max_pixels: int = field(default_factory=lambda: envs.get("PAGODA_IMAGE_MAX_PIXELS"))

    @classmethod
    def from_flags(cls, allowed_media_domains: Iterable[str] | None = None,
                   allowed_local_media_path: str | None = None, **overrides) -> MediaLimits:
        """From the CLI's values (`--allowed-media-domains a b`, `--allowed-local-media-path`)."""
        domains = None
        if allowed_media_domains:
            domains = frozenset(d.strip().lower() for d in allowed_media_domains if d.strip())
        return cls(allowed_media_domains=domains,
                   allowed_local_media_path=allowed_local_media_path or None, **overrides)


# (seconds, outcome) for each http(s) fetch: "ok", "cache_hit" or the error's code.
FetchObserver = Callable[[float, str], None]


class MediaConnector:
    """Turns a URL into bytes or a decoded RGB image under `MediaLimits`. Thread-safe
    (one httpx client per fetch; the cache writes whole files by rename)."""

    def __init__(self, limits: MediaLimits | None = None,
                 observer: FetchObserver | None = None) -> None:
        self.limits = limits or MediaLimits()
        self.observer = observer

    # -- public ---------------------------------------------------------------------
    def load_image(self, url: str) -> Image.Image:
        """The image at `url`, decoded and converted to RGB."""
        return decode_image(self.load_bytes(url), self.limits.max_pixels)

    def load_bytes(self, url: str) -> bytes:
        """The raw bytes `url` names, within the limits; MediaError otherwise."""
        if not isinstance(url, str) or not url:
            raise UnsupportedMediaURLError("image_url.url must be a non-empty string.")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url(url)
        if scheme == "file":
            return self._local_file(url)
        if scheme in ("http", "https"):
            return self._fetch_observed(url)
        raise UnsupportedMediaURLError(
            f"image URL scheme {scheme or '(none)'!r} is not supported; use data:, http(s):"
            " or file: (file: only under --allowed-local-media-path).")

    # -- data: and file: ------------------------------------------------------------
    def _data_url(self, url: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.lower().endswith(";base64"):
            raise MediaDecodeError("a data: image URL must be base64 "
                                   "(data:image/png;base64,...).")
        if len(payload) * 3 // 4 > self.limits.max_bytes + 3:
            raise MediaTooLargeError(self._too_large("the data: URL"))
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaDecodeError("the data: URL's payload is not valid base64.") from None
        if len(data) > self.limits.max_bytes:
            raise MediaTooLargeError(self._too_large("the data: URL"))
        return data

    def _local_file(self, url: str) -> bytes:
        root = self.limits.allowed_local_media_path
        if not root:
            raise LocalMediaPathError("file:// URLs are refused: the server was not started "
                                      "with --allowed-local-media-path.")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise LocalMediaPathError("a file:// URL must name a local path (file:///...).")
        path = Path(os.path.realpath(unquote(parts.path)))
        allowed = Path(os.path.realpath(root))
        if path != allowed and allowed not in path.parents:
            raise LocalMediaPathError("the file:// path is outside --allowed-local-media-path.")
        try:
            if path.stat().st_size > self.limits.max_bytes:
                raise MediaTooLargeError(self._too_large("the file"))
            return path.read_bytes()
        except OSError:
            raise MediaFetchError("the file:// path cannot be read.") from None

    # -- http(s) --------------------------------------------------------------------
    def _fetch_observed(self, url: str) -> bytes:
        start = time.perf_counter()
        outcome = "ok"
        try:
            data, cached = self._fetch(url)
            outcome = "cache_hit" if cached else "ok"
            return data
        except MediaError as exc:
            outcome = exc.code
            raise
        finally:
            if self.observer is not None:
                self.observer(time.perf_counter() - start, outcome)

    def _fetch(self, url: str) -> tuple[bytes, bool]:
        """(bytes, whether they came from the cache). The host is checked before the cache
        is read: a URL cached while allowed is not served once its host no longer is."""
        check_host(url, self.limits.allowed_media_domains)
        cached = self._cache_read(url)
        if cached is not None:
            return cached, True
        deadline = time.monotonic() + self.limits.timeout
        attempt = 0
        while True:
            try:
                data = self._fetch_once(url, deadline)
                break
            except _Retryable as exc:
                attempt += 1
                if attempt > self.limits.max_retries or time.monotonic() >= deadline:
                    raise exc.error from None
                time.sleep(min(0.1 * 2 ** attempt, max(0.0, deadline - time.monotonic())))
        self._cache_write(url, data)
        return data, False

    def _fetch_once(self, url: str, deadline: float) -> bytes:
        """One attempt: follow redirects by hand (each hop's host checked), stream the
        body under the byte cap and the deadline."""
        with httpx.Client(follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise MediaFetchTimeoutError(self._timed_out(url))
                target, headers, extensions = pinned_request(
                    url, check_host(url, self.limits.allowed_media_domains))
                try:
                    with client.stream("GET", target, headers=headers, extensions=extensions,
                                       timeout=remaining) as response:
                        check_peer(response, url, self.limits.allowed_media_domains)
                        if response.is_redirect:
                            url = self._next_hop(url, response)
                            continue
                        if response.status_code >= 500:
                            raise _Retryable(MediaFetchError(
                                f"fetching the image from {_host(url)} failed: "
                                f"HTTP {response.status_code}."))
                        if response.status_code >= 400:
                            raise MediaFetchError(f"fetching the image from {_host(url)} "
                                                  f"failed: HTTP {response.status_code}.")
                        return self._read_body(response, url, deadline)
                except httpx.TimeoutException:
                    raise _Retryable(MediaFetchTimeoutError(self._timed_out(url))) from None
                except httpx.TransportError as exc:
                    raise _Retryable(MediaFetchError(
                        f"fetching the image from {_host(url)} failed: "
                        f"{type(exc).__name__}.")) from None
        raise MediaRedirectNotAllowedError(
            f"fetching the image from {_host(url)}: more than {MAX_REDIRECTS} redirects.")

    def _next_hop(self, url: str, response: httpx.Response) -> str:
        location = response.headers.get("location")
        if not location:
            raise MediaFetchError(f"{_host(url)} answered a redirect with no Location.")
        target = urljoin(url, location)
        if urlsplit(target).scheme.lower() not in ("http", "https"):
            raise MediaRedirectNotAllowedError("the image URL redirected to a non-http URL.")
        try:
            check_host(target, self.limits.allowed_media_domains)
        except MediaDomainNotAllowedError as exc:
            raise MediaRedirectNotAllowedError(
                f"the image URL redirected to a host that is not allowed: {exc}") from None
        return target

    def _read_body(self, response: httpx.Response, url: str, deadline: float) -> bytes:
        declared = response.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.limits.max_bytes:
            raise MediaTooLargeError(self._too_large(f"the image at {_host(url)}"))
        body = bytearray()
        for chunk in response.iter_bytes(_CHUNK):
            body += chunk
            if len(body) > self.limits.max_bytes:
                raise MediaTooLargeError(self._too_large(f"the image at {_host(url)}"))
            if time.monotonic() > deadline:
                raise MediaFetchTimeoutError(self._timed_out(url))
        return bytes(body)

    # -- cache ----------------------------------------------------------------------
    def _cache_path(self, url: str) -> Path | None:
        if not self.limits.cache_dir:
            return None
        return Path(self.limits.cache_dir) / hashlib.sha256(url.encode()).hexdigest()

    def _cache_read(self, url: str) -> bytes | None:
        path = self._cache_path(url)
        if path is None:
            return None
        try:
            if path.stat().st_size > self.limits.max_bytes:
                return None  # cached under a larger cap: fetch (and refuse) again
            return path.read_bytes()
        except OSError:
            return None

    def _cache_write(self, url: str, data: bytes) -> None:
        path = self._cache_path(url)
        if path is None:
            return
        try:  # whole file by rename: a reader never sees half an image
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".part-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            pass  # a cache that cannot be written costs a refetch, never the request

    def _too_large(self, what: str) -> str:
        return f"{what} is larger than the limit of {self.limits.max_bytes} bytes."

    def _timed_out(self, url: str) -> str:
        return (f"fetching the image from {_host(url)} timed out after "
                f"{self.limits.timeout:g} s.")


class _Retryable(Exception):
    """A transport failure worth another attempt; `error` is what the caller sees."""

    def __init__(self, error: MediaError) -> None:
        super().__init__(str(error))
        self.error = error


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """Decode `data` to an RGB image; the pixel count is checked from the header first."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ImageTooManyPixelsError(
                    f"the image is {width}x{height} = {width * height} pixels, more than "
                    f"the limit of {max_pixels}.")
            image.load()
            return image.convert("RGB")
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageTooManyPixelsError("the image is a decompression bomb.") from None
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise MediaDecodeError(f"the image cannot be decoded ({type(exc).__name__}).") from None


def check_host(url: str, allowed: frozenset[str] | None) -> list[str] | None:
    """Refuse `url` unless its host is allowed (see the module docstring). Returns the
    vetted addresses the fetch must connect to; None for an allow-listed host (the
    operator named it: it is connected to by name)."""
    host = _host(url)
    if not host:
        raise MediaDomainNotAllowedError("the image URL has no host.")
    if allowed is not None:
        if host not in allowed:
            raise MediaDomainNotAllowedError(
                f"the image URL's host {host!r} is not in --allowed-media-domains.")
        return None
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise MediaFetchError(f"the image URL's host {host!r} does not resolve.") from None
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        if not is_public_address(address):
            raise MediaDomainNotAllowedError(
                f"the image URL's host {host!r} resolves to a non-public address; list it in "
                "--allowed-media-domains to allow it.")
    return addresses


def pinned_request(url: str, addresses: list[str] | None
                   ) -> tuple[str, dict[str, str], dict[str, str]]:
    """(URL to connect to, headers, httpx extensions): the URL with its host replaced by
    the first vetted address, the original host in `Host` and, for https, as the TLS
    server name (certificates are still checked against the host, not the address).
    Unchanged for None (an allow-listed host)."""
    if not addresses:
        return url, {}, {}
    parts = urlsplit(url)
    address = addresses[0].split("%", 1)[0]
    netloc = (f"[{address}]" if ":" in address else address) + \
        (f":{parts.port}" if parts.port else "")
    target = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
    host_header = parts.netloc.rsplit("@", 1)[-1]
    extensions = {"sni_hostname": parts.hostname} if parts.scheme.lower() == "https" else {}
    return target, {"Host": host_header}, extensions


def check_peer(response: httpx.Response, url: str, allowed: frozenset[str] | None) -> None:
    """After connecting: without an allow-list, the peer must still be public."""
    if allowed is not None:
        return
    stream = response.extensions.get("network_stream")
    peer = stream.get_extra_info("server_addr") if stream is not None else None
    if peer and not is_public_address(peer[0]):
        raise MediaDomainNotAllowedError(
            f"the image URL's host {_host(url)!r} connected to a non-public address.")


def is_public_address(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                or ip.is_reserved or ip.is_unspecified)


def _host(url: str) -> str:
    try:
        return (urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""

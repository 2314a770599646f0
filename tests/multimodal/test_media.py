"""pagoda.multimodal.media against a loopback HTTP server: each rule refuses with its own
error, and what is allowed loads."""

from __future__ import annotations

import base64
import time

import pytest
from media_server import MediaServer, png_bytes

from pagoda.multimodal import media
from pagoda.multimodal.media import MediaConnector, MediaLimits


@pytest.fixture(scope="module")
def server():
    with MediaServer(slow_seconds=2.0) as s:
        yield s


def connector(**overrides) -> MediaConnector:
    settings = dict(allowed_media_domains=frozenset({"127.0.0.1"}), timeout=1.0,
                    max_retries=0, cache_dir=None, max_bytes=100_000, max_pixels=10_000)
    settings.update(overrides)
    return MediaConnector(MediaLimits(**settings))


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_an_allowed_http_image_loads_as_rgb(server):
    image = connector().load_image(server.url("/ok.png"))
    assert image.mode == "RGB" and image.size == (16, 12)
    assert image.getpixel((0, 0)) == (200, 30, 60)


def test_a_data_url_image_loads():
    image = connector().load_image(data_url(png_bytes((5, 7), (1, 2, 3))))
    assert image.size == (5, 7) and image.getpixel((4, 6)) == (1, 2, 3)


@pytest.mark.parametrize("url", ["data:image/png;base64,!!notbase64!!",
                                 "data:image/png," + "x" * 10,
                                 data_url(b"GIF89a but not really an image")])
def test_undecodable_data_urls_are_refused(url):
    with pytest.raises(media.MediaDecodeError):
        connector().load_image(url)


def test_undecodable_fetched_bytes_are_refused(server):
    with pytest.raises(media.MediaDecodeError, match="cannot be decoded"):
        connector().load_image(server.url("/garbage.png"))


def test_too_many_bytes_are_refused_fetched_and_inline(server):
    with pytest.raises(media.MediaTooLargeError, match="100000 bytes"):
        connector().load_bytes(server.url("/big.bin"))
    with pytest.raises(media.MediaTooLargeError):
        connector().load_bytes(data_url(b"\0" * 200_000))


def test_too_many_pixels_are_refused_before_decoding():
    # 200 x 100 = 20,000 pixels > 10,000: refused from the header.
    with pytest.raises(media.ImageTooManyPixelsError, match="200x100"):
        connector().load_image(data_url(png_bytes((200, 100))))


def test_a_host_outside_the_allowed_domains_is_refused(server):
    before = sum(server.hits.values())
    with pytest.raises(media.MediaDomainNotAllowedError, match="allowed-media-domains"):
        connector().load_bytes(server.url("/ok.png", host="localhost"))
    assert sum(server.hits.values()) == before  # refused before any connection


def test_without_an_allow_list_loopback_is_refused(server):
    before = sum(server.hits.values())
    with pytest.raises(media.MediaDomainNotAllowedError, match="non-public"):
        connector(allowed_media_domains=None).load_bytes(server.url("/ok.png"))
    assert sum(server.hits.values()) == before  # no request ever reached the server


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "192.168.0.1", "169.254.169.254",
                                     "::1", "fe80::1", "0.0.0.0", "::ffff:127.0.0.1"])
def test_private_addresses_are_not_public(address):
    assert not media.is_public_address(address)


def test_public_addresses_are_public():
    assert media.is_public_address("8.8.8.8") and media.is_public_address("2606:4700::1111")


def test_a_redirect_to_a_disallowed_host_is_refused(server):
    target = server.url("/ok.png", host="localhost")
    before = server.hits["/ok.png"]
    with pytest.raises(media.MediaRedirectNotAllowedError, match="redirected"):
        connector().load_bytes(server.url(f"/redirect?to={target}"))
    assert server.hits["/ok.png"] == before  # the redirect was never followed


def test_a_redirect_to_an_allowed_host_is_followed(server):
    image = connector().load_image(server.url(f"/redirect?to={server.url('/other.png')}"))
    assert image.getpixel((0, 0)) == (10, 200, 10)


def test_a_slow_server_times_out_within_the_timeout(server):
    start = time.monotonic()
    with pytest.raises(media.MediaFetchTimeoutError, match="timed out after 0.5 s"):
        connector(timeout=0.5).load_bytes(server.url("/slow.png"))
    assert time.monotonic() - start < 1.5


def test_a_transient_5xx_is_retried(server):
    # A generous deadline: the retry must not lose to a loaded machine's scheduling.
    assert connector(max_retries=1, timeout=15.0).load_image(
        server.url("/flaky.png")).size == (16, 12)
    with pytest.raises(media.MediaFetchError, match="HTTP 404"):
        connector(max_retries=3).load_bytes(server.url("/missing"))
    assert server.hits["/missing"] == 1  # a 4xx is not retried


def test_file_urls_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    ok = connector(allowed_local_media_path=str(allowed))
    assert ok.load_image(f"file://{allowed}/a.png").size == (16, 12)
    for url in (f"file://{tmp_path}/secret.png", f"file://{allowed}/../secret.png",
                f"file://{allowed}/link.png"):
        with pytest.raises(media.LocalMediaPathError, match="outside"):
            ok.load_bytes(url)
    with pytest.raises(media.LocalMediaPathError, match="allowed-local-media-path"):
        connector().load_bytes(f"file://{allowed}/a.png")


def test_the_cache_serves_a_url_again_without_fetching(server, tmp_path):
    outcomes = []
    c = MediaConnector(connector(cache_dir=str(tmp_path)).limits,
                       observer=lambda seconds, outcome: outcomes.append(outcome))
    url = server.url("/other.png")
    first = c.load_bytes(url)
    hits = server.hits["/other.png"]
    assert c.load_bytes(url) == first
    assert server.hits["/other.png"] == hits  # the second came from disk
    assert outcomes == ["ok", "cache_hit"]
    # The host is checked before the cache: an operator who drops a domain stops it.
    with pytest.raises(media.MediaDomainNotAllowedError):
        connector(cache_dir=str(tmp_path), allowed_media_domains=frozenset({"x"})
                  ).load_bytes(url)


def test_unsupported_schemes_are_refused():
    for url in ("ftp://127.0.0.1/a.png", "gopher://x", "just-a-path.png"):
        with pytest.raises(media.UnsupportedMediaURLError):
            connector().load_bytes(url)


def test_every_media_error_is_a_value_error():
    # The services map ValueError to 400 / INVALID_ARGUMENT.
    for cls in (media.MediaDecodeError, media.MediaTooLargeError, media.ImageTooManyPixelsError,
                media.MediaDomainNotAllowedError, media.MediaRedirectNotAllowedError,
                media.MediaFetchTimeoutError, media.LocalMediaPathError):
        assert issubclass(cls, ValueError)


def test_the_connected_address_is_checked_too(server, monkeypatch):
    # A name that resolved to a public address at the check but connects to loopback
    # (DNS rebinding): stood in for by skipping the check before connecting.
    monkeypatch.setattr(media, "check_host", lambda url, allowed: None)
    with pytest.raises(media.MediaDomainNotAllowedError, match="connected to a non-public"):
        connector(allowed_media_domains=None).load_bytes(server.url("/ok.png"))


def test_a_name_that_rebinds_after_the_check_is_not_followed(monkeypatch):
    """DNS rebinding: the host resolves to a vetted address for the check and to an inner
    one afterwards. The GET goes to the vetted address (Host header kept); the inner
    service never sees a request. Here 127.0.0.2 plays the public address."""
    import socket
    with MediaServer(bind="127.0.0.2") as outer, \
            MediaServer(bind="127.0.0.1", port=outer.port) as inner:
        checking = []
        real_getaddrinfo, real_check_host = socket.getaddrinfo, media.check_host

        def check_host(url, allowed):  # the checks' lookups see the vetted address
            checking.append(url)
            try:
                return real_check_host(url, allowed)
            finally:
                checking.pop()

        def rebinding(host, *args, **kwargs):  # any other lookup sees the inner one
            if host != "images.example":
                return real_getaddrinfo(host, *args, **kwargs)
            address = "127.0.0.2" if checking else "127.0.0.1"
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, outer.port))]

        monkeypatch.setattr(socket, "getaddrinfo", rebinding)
        monkeypatch.setattr(media, "check_host", check_host)
        monkeypatch.setattr(media, "is_public_address", lambda a: a == "127.0.0.2")
        url = outer.url("/ok.png", host="images.example")
        assert connector(allowed_media_domains=None).load_image(url).size == (16, 12)
        assert inner.hits["/ok.png"] == 0 and outer.hits["/ok.png"] == 1

"""Make a `prometheus` server binary available (the observability tests scrape with it).

Order: `$PROMETHEUS` (a path) if set; else `prometheus` on PATH; else, on Debian or
Ubuntu, install Debian's `prometheus` package with apt-get (`apt-get update` first,
then `apt-get install --no-install-recommends prometheus`), as root or through sudo.
Idempotent: when a binary is found nothing is installed. The package's service is not
needed (the tests start their own server on loopback); Debian images with a
policy-rc.d that forbids starting services install it without starting it.

    python tools/install_prometheus.py          # prints the binary's path
    python tools/install_prometheus.py --check  # exit 1 (no install) when missing

Exit status 0 when a binary is available afterwards. Where it cannot be installed
(no apt-get, no root and no sudo) the script says why and exits 0 unless `--strict`:
`make install` must not fail on a laptop without root; the tests that need
Prometheus then skip, naming this script.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

DEBIAN_PACKAGE = "prometheus"
DEBIAN_PATHS = ("/usr/bin/prometheus",)


def find_prometheus() -> Path | None:
    """The prometheus binary to use, or None."""
    override = os.environ.get("PROMETHEUS")
    if override:
        return Path(override) if Path(override).is_file() else None
    found = shutil.which("prometheus")
    if found:
        return Path(found)
    for path in DEBIAN_PATHS:  # PATH may lack /usr/bin in odd environments
        if Path(path).is_file():
            return Path(path)
    return None


def _privilege_prefix() -> list[str] | None:
    """[] as root, ["sudo", "-n"] when passwordless sudo works, else None."""
    if os.geteuid() == 0:
        return []
    sudo = shutil.which("sudo")
    if sudo and subprocess.run([sudo, "-n", "true"], capture_output=True).returncode == 0:
        return [sudo, "-n"]
    return None


def install_with_apt() -> str | None:
    """Install the Debian package; returns None on success, else why not."""
    apt = shutil.which("apt-get")
    if apt is None:
        return "apt-get is not available (not Debian/Ubuntu)"
    prefix = _privilege_prefix()
    if prefix is None:
        return "installing a system package needs root or passwordless sudo"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in ([*prefix, apt, "update", "-q"],
                 [*prefix, apt, "install", "-y", "-q", "--no-install-recommends",
                  DEBIAN_PACKAGE]):
        print("+", " ".join(argv), file=sys.stderr, flush=True)
        result = subprocess.run(argv, env=env)
        if result.returncode != 0:
            return f"`{' '.join(argv)}` exited with {result.returncode}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Only look; never install.")
    parser.add_argument("--strict", action="store_true",
                        help="Exit 1 when Prometheus cannot be installed.")
    args = parser.parse_args(argv)
    path = find_prometheus()
    if path is None and not args.check:
        why = install_with_apt()
        path = find_prometheus()
        if path is None:
            print(f"install_prometheus: not installed: {why or 'no binary after install'}",
                  file=sys.stderr)
            return 1 if args.strict else 0
    if path is None:
        print("install_prometheus: prometheus is not installed", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

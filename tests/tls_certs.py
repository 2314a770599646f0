"""Throw-away certificates for the mutual-TLS tests, made with the openssl CLI.

`make_certs(folder)` writes a CA, a service certificate it signed (subjectAltName
DNS:SERVER_NAME, usable as server and client), and a rogue CA with a certificate
of the same name, so a test can show that only the right CA's certificates get in.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_NAME = "pagoda-grpc"


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path
    rogue_ca: Path
    rogue_cert: Path
    rogue_key: Path

    def flags(self) -> list[str]:
        return ["--grpc-tls-cert", str(self.cert), "--grpc-tls-key", str(self.key),
                "--grpc-tls-ca", str(self.ca), "--grpc-tls-server-name", SERVER_NAME]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _authority(folder: Path, name: str) -> tuple[Path, Path, Path]:
    """(ca.pem, cert.pem, key.pem) of a new CA `name` and a certificate it signed."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.pem",
             "-days", "2", "-subj", f"/CN={name} test CA", cwd=folder)
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={SERVER_NAME}", cwd=folder)
    (folder / f"{name}.ext").write_text(f"subjectAltName=DNS:{SERVER_NAME}\n"
                                        "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.pem",
             "-CAkey", f"{name}-ca.key", "-CAcreateserial", "-out", f"{name}.pem",
             "-days", "2", "-extfile", f"{name}.ext", cwd=folder)
    return folder / f"{name}-ca.pem", folder / f"{name}.pem", folder / f"{name}.key"


def make_certs(folder: Path) -> Certs:
    folder.mkdir(parents=True, exist_ok=True)
    return Certs(*_authority(folder, "pagoda"), *_authority(folder, "rogue"))

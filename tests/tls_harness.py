"""Certificates made by `openssl` for the TLS tests: a CA, a server certificate it signed (for localhost and
127.0.0.1), a client certificate it signed (mutual TLS), and a stranger CA that signed nothing here."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_ca: Path  # a CA nothing here was signed by: a client that trusts it only must be refused

    @property
    def server_pem(self) -> Path:
        """The certificate and its key in one file (HAProxy's `crt`)."""
        both = self.server_cert.with_name("server-with-key.pem")
        if not both.exists():
            both.write_text(self.server_cert.read_text() + self.server_key.read_text())
        return both


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key),
             "-out", str(cert), "-days", "2", "-subj", f"/CN={name}", cwd=directory)
    return cert, key


def _signed(directory: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    key, csr, cert, ext = (directory / f"{name}{suffix}" for suffix in (".key", ".csr", ".pem", ".ext"))
    ext.write_text(extensions + "\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key),
             "-out", str(csr), "-subj", f"/CN={name}", cwd=directory)
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-out", str(cert), "-days", "2", "-extfile", str(ext), cwd=directory)
    return cert, key


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "test-ca")
    server = _signed(directory, "server", ca, "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                     "extendedKeyUsage=serverAuth")
    client = _signed(directory, "client", ca, "extendedKeyUsage=clientAuth")
    stranger, _ = _ca(directory, "stranger-ca")
    return Pki(ca[0], *server, *client, stranger)

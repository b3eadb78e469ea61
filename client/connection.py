"""How a client reaches the server: TLS or not (a CA file, or the system's roots), a client certificate for mutual
TLS, and the user's key, sent in the gRPC header the server checks (docs/security.md).

A key is read from a file (`--key-file`) or the LINGBOT_KEY environment variable, never from a flag: a command
line is visible to every user of the host.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

import tritonclient.grpc as grpcclient

from backend.api.contract import KEY_HEADER

KEY_VARIABLE = "LINGBOT_KEY"


@dataclass(frozen=True)
class Connection:
    ca: Path | None = None  # TLS, trusting this PEM CA
    system_roots: bool = False  # TLS, trusting the system's CAs (a server with a public certificate)
    client_cert: Path | None = None  # mutual TLS: this client's PEM certificate and key
    client_key: Path | None = None
    key: str | None = field(default=None, repr=False)  # the user's key (never printed)

    @property
    def tls(self) -> bool:
        return self.ca is not None or self.system_roots or self.client_cert is not None

    def client(self, url: str, verbose: bool = False) -> grpcclient.InferenceServerClient:
        if not self.tls:
            return grpcclient.InferenceServerClient(url=url, verbose=verbose)
        return grpcclient.InferenceServerClient(
            url=url, verbose=verbose, ssl=True, root_certificates=None if self.ca is None else str(self.ca),
            private_key=None if self.client_key is None else str(self.client_key),
            certificate_chain=None if self.client_cert is None else str(self.client_cert))

    def headers(self) -> dict[str, str] | None:
        """The stream's headers: the key's (Triton forwards it to the model), or none."""
        return {KEY_HEADER: self.key} if self.key else None

    def with_key(self, key: str | None) -> Connection:
        return Connection(self.ca, self.system_roots, self.client_cert, self.client_key, key)


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ca", type=Path, help="speak TLS, trusting this PEM CA (a server with its own CA)")
    parser.add_argument("--tls", action="store_true", help="speak TLS, trusting the system's CAs")
    parser.add_argument("--client-cert", type=Path, help="mutual TLS: this client's PEM certificate (with "
                        "--client-key)")
    parser.add_argument("--client-key", type=Path, help="the PEM private key of --client-cert")
    parser.add_argument("--key-file", type=Path, help=f"a file holding your key (else ${KEY_VARIABLE}, else no key); "
                        "a server with a keys file refuses requests without one")


def connection_of(args: argparse.Namespace) -> Connection:
    """ValueError names what is wrong."""
    if (args.client_cert is None) != (args.client_key is None):
        raise ValueError("--client-cert and --client-key go together")
    key = args.key_file.read_text().strip() if args.key_file else os.environ.get(KEY_VARIABLE) or None
    return Connection(args.ca, args.tls, args.client_cert, args.client_key, key)

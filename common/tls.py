"""TLS on Tandem's links: mutual TLS between the router and the model services, and TLS on the
router's public doors, from PEM files (a Kubernetes TLS Secret's tls.crt, tls.key, ca.crt).

    server: --tls-cert + --tls-key; with --tls-ca it requires client certificates signed by that CA
    client: --tls-ca verifies the server (system roots without it); --tls-cert + --tls-key is the
            client's own certificate, for servers that require one

Rotation: certificate files are re-read when they change (common.reload: checked at most every
2 s, by whoever uses them) or after SIGHUP. A gRPC server hands new files to every handshake that
follows, so connections already open, and the sequences on them, are not touched. A new set is
taken only whole and valid (the key matches the certificate, the CA parses); until then the
current one stays. Torch-free: the router imports it."""

from __future__ import annotations

import argparse
import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.reload import POLL_S, FileSet

log = logging.getLogger(__name__)


class TLSError(Exception):
    """A certificate, key or CA file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class TLSFiles:
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a certificate and its private key go together: give both or neither")

    def paths(self) -> list[Path]:
        return [p for p in (self.cert, self.key, self.ca) if p is not None]


@dataclass(frozen=True)
class PEM:
    cert: bytes | None
    key: bytes | None
    ca: bytes | None


def read_pem(files: TLSFiles) -> PEM:
    """The files' contents, checked: the key matches the certificate and the CA bundle parses."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        if files.cert is not None:
            probe.load_cert_chain(files.cert, files.key)
        ca = files.ca.read_bytes() if files.ca is not None else None
        if ca is not None:
            probe.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        cert = files.cert.read_bytes() if files.cert is not None else None
        key = files.key.read_bytes() if files.key is not None else None
    except (OSError, ssl.SSLError, ValueError) as err:
        raise TLSError(f"{', '.join(map(str, files.paths()))}: {err}") from None
    return PEM(cert, key, ca)


class Certificates:
    """One set of TLS files, kept current: `pem` is the last good set, `generation` counts changes."""

    def __init__(self, files: TLSFiles, poll_s: float = POLL_S) -> None:
        self.files = files
        self.poll_s = poll_s
        self._watch = FileSet(files.paths(), poll_s)
        self._lock = threading.Lock()
        self.pem = read_pem(files)  # TLSError at start-up: refuse to run with unusable files
        self.generation = 0

    def refresh(self) -> int:
        """Re-read the files if they changed (or after SIGHUP); the generation, bumped on a new set."""
        signature = self._watch.due()
        if signature is None:
            return self.generation
        with self._lock:
            try:
                pem = read_pem(self.files)
            except TLSError as err:
                log.warning("TLS files changed but cannot be used yet; keeping the current ones: %s", err)
                return self.generation
            if self._watch.signature() != signature:  # written while we read: take it at the next look
                return self.generation
            self._watch.accept(signature)
            if pem != self.pem:
                self.pem = pem
                self.generation += 1
                log.info("TLS certificates reloaded from %s", ", ".join(map(str, self.files.paths())))
        return self.generation


def server_credentials(certs: Certificates) -> grpc.ServerCredentials:
    """TLS for a gRPC server; with a CA in the files, client certificates are required and verified.
    Every new connection's handshake uses the files as they are then (rotation without restart)."""
    if certs.pem.cert is None:
        raise TLSError("a TLS server needs a certificate and its key (--tls-cert, --tls-key)")
    handed_out = [certs.generation]

    def config() -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(certs.pem.key, certs.pem.cert)], certs.pem.ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:  # on gRPC's threads, before each handshake
        try:
            generation = certs.refresh()
        except Exception:  # an exception here would fail the handshake; keep the current files
            log.exception("reloading TLS files failed")
            return None
        if generation == handed_out[0]:
            return None
        handed_out[0] = generation
        return config()

    return grpc.dynamic_ssl_server_credentials(config(), fetch,
                                               require_client_authentication=certs.pem.ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    """How a client reaches a TLS server: its certificates and, where the address is not a name in
    the server's certificate (a pod IP found through discovery), the name to check instead."""

    certs: Certificates
    server_name: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        pem = self.certs.pem
        return grpc.ssl_channel_credentials(pem.ca, pem.key, pem.cert)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


# ---- the HTTP door (uvicorn) ---------------------------------------------------------------------
def uvicorn_ssl(files: TLSFiles) -> dict:
    """uvicorn.Config arguments for HTTPS; with a CA, client certificates are required."""
    if files.cert is None:
        raise TLSError("HTTPS needs a certificate and its key")
    return {"ssl_certfile": str(files.cert), "ssl_keyfile": str(files.key),
            "ssl_ca_certs": str(files.ca) if files.ca else None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if files.ca else ssl.CERT_NONE}


def reload_ssl_context(context: ssl.SSLContext, certs: Certificates) -> None:
    """Give a live server SSLContext the current files: later handshakes use them. A CA is added
    to those trusted, never removed (OpenSSL has no way to): dropping a CA takes a restart."""
    files = certs.files
    context.load_cert_chain(files.cert, files.key)
    if files.ca is not None:
        context.load_verify_locations(cafile=files.ca)


# ---- flags ---------------------------------------------------------------------------------------
def add_tls_args(parser: argparse.ArgumentParser, prefix: str = "", title: str = "TLS",
                 description: str = "") -> argparse._ArgumentGroup:
    """--{prefix}tls-cert, --{prefix}tls-key, --{prefix}tls-ca, in a group (returned)."""
    group = parser.add_argument_group(title, description or None)
    group.add_argument(f"--{prefix}tls-cert", type=Path, default=None, help="certificate chain (PEM)")
    group.add_argument(f"--{prefix}tls-key", type=Path, default=None, help="private key of the certificate (PEM)")
    group.add_argument(f"--{prefix}tls-ca", type=Path, default=None, help="CA bundle (PEM) the peer must chain to")
    return group


def files_from_args(args: argparse.Namespace, prefix: str = "") -> TLSFiles | None:
    """The --{prefix}tls-* files, or None when none is given. ValueError names the flags."""
    attr = prefix.replace("-", "_") + "tls_"
    cert, key, ca = (getattr(args, attr + part) for part in ("cert", "key", "ca"))
    if cert is None and key is None and ca is None:
        return None
    if (cert is None) != (key is None):
        raise ValueError(f"--{prefix}tls-cert and --{prefix}tls-key go together")
    return TLSFiles(cert, key, ca)

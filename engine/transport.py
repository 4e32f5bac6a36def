"""How a model service listens: plaintext, TLS, or mutual TLS (--tls-cert, --tls-key, --tls-ca;
common.tls), and optionally grpc.health.v1 alone in plaintext on --health-port, for probes that
cannot speak TLS (the kubelet's). engine.service.serve() opens its ports through open_ports()."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from common.tls import Certificates, TLSError, add_tls_args, files_from_args, server_credentials


def add_transport_args(parser: argparse.ArgumentParser) -> None:
    group = add_tls_args(parser, title="TLS", description="serve over TLS (--tls-cert, --tls-key); with --tls-ca, "
                         "mutual TLS: only clients with a certificate from that CA get in. Plaintext is then "
                         "refused. The files are re-read when they change and on SIGHUP.")
    group.add_argument("--health-port", type=int, default=0,
                       help="also serve grpc.health.v1 alone, in plaintext, on this port (for probes that cannot "
                            "speak TLS, such as the kubelet's); 0: off")


@dataclass(frozen=True)
class Transport:
    certs: Certificates | None = None  # None: plaintext
    health_port: int = 0  # 0: no health-only port

    def describe(self) -> str:
        mode = "plaintext" if self.certs is None else "mutual TLS" if self.certs.pem.ca else "TLS"
        return mode + (f"; health alone in plaintext on port {self.health_port}" if self.health_port else "")


def transport_from_args(args: argparse.Namespace) -> Transport:
    """Checked before the model loads, so unusable certificate files fail in seconds, not minutes."""
    try:
        files = files_from_args(args)
        if files is not None and files.cert is None:
            raise ValueError("--tls-ca without --tls-cert and --tls-key: a TLS server needs its own certificate")
        return Transport(Certificates(files) if files else None, args.health_port)
    except (ValueError, TLSError) as err:
        raise SystemExit(f"TLS: {err}") from None


async def open_ports(server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, host: str, port: int,
                     transport: Transport) -> tuple[int, grpc.aio.Server | None]:
    """Bind the service's port as the transport says; start the health-only server if asked.
    Returns the bound port and that server (to stop with the service)."""
    if transport.certs is not None:
        bound = server.add_secure_port(f"{host}:{port}", server_credentials(transport.certs))
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if not transport.health_port:
        return bound, None
    probes = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probes)
    probes.add_insecure_port(f"{host}:{transport.health_port}")
    await probes.start()
    return bound, probes

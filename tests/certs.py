"""Test PKI made at test time with `cryptography`: certificate authorities and the leaf
certificates they sign, written as PEM files the way a Kubernetes TLS Secret mounts them
(tls.crt, tls.key, ca.crt in one directory)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.tls import TLSFiles

LOOPBACK_NAMES = ("localhost", "127.0.0.1")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for n in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            entries.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(entries)


@dataclass(frozen=True)
class Leaf:
    cert_pem: bytes
    key_pem: bytes
    serial: int


class CA:
    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.name = _name(name)
        self.cert = (x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, names: tuple[str, ...] = LOOPBACK_NAMES, server: bool = True,
              client: bool = True) -> Leaf:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH]
                                                                          if client else [])
        serial = x509.random_serial_number()
        cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(self.name)
                .public_key(key.public_key()).serial_number(serial)
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(_san(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                .sign(self.key, hashes.SHA256()))
        return Leaf(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key), serial)

    def write(self, directory: Path, leaf: Leaf, ca_pem: bytes | None = None) -> TLSFiles:
        """tls.crt, tls.key and ca.crt (this CA unless ca_pem says otherwise) in directory."""
        directory.mkdir(parents=True, exist_ok=True)
        files = TLSFiles(cert=directory / "tls.crt", key=directory / "tls.key", ca=directory / "ca.crt")
        write_atomically(files.cert, leaf.cert_pem)
        write_atomically(files.key, leaf.key_pem)
        write_atomically(files.ca, ca_pem if ca_pem is not None else self.pem)
        return files


def write_atomically(path: Path, data: bytes) -> None:
    """Rename into place, as the kubelet's Secret volume does: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def serial_of(cert_pem_or_der: bytes) -> int:
    if cert_pem_or_der.startswith(b"-----"):
        return x509.load_pem_x509_certificate(cert_pem_or_der).serial_number
    return x509.load_der_x509_certificate(cert_pem_or_der).serial_number

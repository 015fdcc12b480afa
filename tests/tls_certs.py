"""Throw-away PKI for TLS tests: a self-signed CA made in the test, and certificates it signs.

Real X.509 (the `cryptography` package), written as PEM files the way an operator (or cert-manager)
would hand them to the router: a server certificate for 127.0.0.1 / localhost, client certificates
for mutual TLS. Keys are P-256 (fast to make); every certificate lives for a day.
"""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAMES = ("localhost", "router.test")


@dataclass(frozen=True)
class Issued:
    """PEM files of one certificate and its key (and the CA that signed it)."""

    cert_file: Path
    key_file: Path
    ca_file: Path

    @property
    def cert(self) -> bytes:
        return self.cert_file.read_bytes()

    @property
    def key(self) -> bytes:
        return self.key_file.read_bytes()

    @property
    def ca(self) -> bytes:
        return self.ca_file.read_bytes()


class TestCA:
    """A certificate authority of its own; `issue_server` / `issue_client` write PEM files under `folder`."""

    __test__ = False  # a helper, not a pytest class

    def __init__(self, folder: Path, name: str = "splitserve test CA"):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = _base(subject, subject, self._key.public_key())
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        builder = builder.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False),
                                        critical=True)
        self._cert = builder.sign(self._key, hashes.SHA256())
        self.ca_file = self.folder / f"{_slug(name)}.ca.pem"
        self.ca_file.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    @property
    def ca(self) -> bytes:
        return self.ca_file.read_bytes()

    def issue_server(self, stem: str = "server", names=SERVER_NAMES) -> Issued:
        alt = [x509.DNSName(n) for n in names] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        return self._issue(stem, ExtendedKeyUsageOID.SERVER_AUTH, alt)

    def issue_client(self, stem: str = "client") -> Issued:
        return self._issue(stem, ExtendedKeyUsageOID.CLIENT_AUTH, [])

    def _issue(self, stem: str, usage, alt_names: list) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, stem)])
        builder = _base(subject, self._cert.subject, key.public_key())
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if alt_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        issued = Issued(self.folder / f"{stem}.pem", self.folder / f"{stem}.key", self.ca_file)
        issued.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
        return issued


def _base(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())

"""Throwaway certificates for TLS tests, made with `cryptography` into a folder.

`make_pki(folder)` writes a CA; a server certificate it signed for 127.0.0.1 and
localhost (usable as a client certificate too, as etcd's peer certificates are);
a client certificate with the common name `CLIENT_CN`; and a second, untrusted CA
with a certificate of its own (same names, so only the signature is wrong). EC
P-256 keys: quick to make, and Go's TLS (etcdctl) accepts them.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CLIENT_CN = "alice"
VALIDITY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class CertFiles:
    """One certificate and its key, as PEM files."""

    cert: Path
    key: Path

    def pair(self) -> tuple[bytes, bytes]:
        """(private key, certificate chain) bytes, gRPC's order."""
        return self.key.read_bytes(), self.cert.read_bytes()


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: CertFiles
    client: CertFiles
    untrusted_ca: Path
    untrusted: CertFiles

    def credentials(self, cert: CertFiles | None = None) -> grpc.ChannelCredentials:
        """Channel credentials trusting our CA, presenting `cert` if given."""
        if cert is None:
            return grpc.ssl_channel_credentials(self.ca.read_bytes())
        key, chain = cert.pair()
        return grpc.ssl_channel_credentials(self.ca.read_bytes(), key, chain)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class _Authority:
    def __init__(self, cn: str) -> None:
        now = datetime.datetime.now(datetime.UTC)
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = _name(cn)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )

    def issue(self, folder: Path, stem: str, cn: str, server: bool) -> CertFiles:
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
        cert = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False).sign(
            self.key, hashes.SHA256()
        )
        files = CertFiles(folder / f"{stem}.crt", folder / f"{stem}.key")
        _write_cert(files.cert, cert)
        _write_key(files.key, key)
        return files


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca, other = _Authority("test ca"), _Authority("untrusted ca")
    _write_cert(folder / "ca.crt", ca.cert)
    _write_cert(folder / "untrusted-ca.crt", other.cert)
    return Pki(
        ca=folder / "ca.crt",
        server=ca.issue(folder, "server", "server", server=True),
        client=ca.issue(folder, "client", CLIENT_CN, server=False),
        untrusted_ca=folder / "untrusted-ca.crt",
        untrusted=other.issue(folder, "untrusted", "server", server=True),
    )

"""Certificates and keys for a throwaway local control plane.

One CA signs everything: the apiserver's serving certificate, client
certificates (CN = user, O = groups; the admin is in ``system:masters``) and
nothing else. The ServiceAccount token signing key is a separate RSA pair.
All files are written under ``<dir>/pki`` with private keys mode 0600.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# ClusterIP range: a /16 so thousands of Services fit. Its first address is the `kubernetes` Service,
# which the API server certificate must name (pods on the real node reach the API server there).
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = str(next(ipaddress.ip_network(SERVICE_CIDR).hosts()))

VALIDITY = dt.timedelta(days=365)


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca_crt(self) -> Path: return self.dir / "ca.crt"
    @property
    def ca_key(self) -> Path: return self.dir / "ca.key"
    @property
    def apiserver_crt(self) -> Path: return self.dir / "apiserver.crt"
    @property
    def apiserver_key(self) -> Path: return self.dir / "apiserver.key"
    @property
    def admin_crt(self) -> Path: return self.dir / "admin.crt"
    @property
    def admin_key(self) -> Path: return self.dir / "admin.key"
    @property
    def sa_key(self) -> Path: return self.dir / "sa.key"
    @property
    def sa_pub(self) -> Path: return self.dir / "sa.pub"


def _write_key(path: Path, key) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name(attrs + [x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + VALIDITY))


def _leaf(pki: Pki, ca_key, ca_name, cn: str, orgs: tuple[str, ...], usage, sans=None):
    key = ec.generate_private_key(ec.SECP256R1())
    b = _builder(_name(cn, orgs), ca_name, key.public_key())
    b = b.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    b = b.add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                      data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                      crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
    b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, b.sign(ca_key, hashes.SHA256())


def create_pki(directory: Path) -> Pki:
    """Create (or reuse, if complete) the PKI of one local control plane."""
    pki = Pki(Path(directory))
    pki.dir.mkdir(parents=True, exist_ok=True)
    files = [pki.ca_crt, pki.ca_key, pki.apiserver_crt, pki.apiserver_key, pki.admin_crt,
             pki.admin_key, pki.sa_key, pki.sa_pub]
    if all(f.exists() for f in files):
        return pki

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("tokenfleet-local-ca")
    ca = (_builder(ca_name, ca_name, ca_key.public_key())
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    _write_key(pki.ca_key, ca_key)
    _write_cert(pki.ca_crt, ca)

    sans = [x509.DNSName("localhost"), x509.DNSName("kubernetes"), x509.DNSName("kubernetes.default"),
            x509.DNSName("kubernetes.default.svc"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address(KUBERNETES_SERVICE_IP))]
    key, cert = _leaf(pki, ca_key, ca_name, "kube-apiserver", (), ExtendedKeyUsageOID.SERVER_AUTH, sans)
    _write_key(pki.apiserver_key, key)
    _write_cert(pki.apiserver_crt, cert)

    key, cert = _leaf(pki, ca_key, ca_name, "tokenfleet-admin", ("system:masters",),
                      ExtendedKeyUsageOID.CLIENT_AUTH)
    _write_key(pki.admin_key, key)
    _write_cert(pki.admin_crt, cert)

    # ServiceAccount tokens are signed with RS256 by default: use RSA.
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki.sa_key, sa)
    pki.sa_pub.write_bytes(sa.public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))
    return pki


def node_client_certificate(pki: Pki, node: str, crt: Path, key_path: Path) -> None:
    """A kubelet's client certificate (CN system:node:NAME, O system:nodes), as the Node authorizer and
    NodeRestriction admission expect, signed by the plane's CA."""
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), None)
    ca_name = x509.load_pem_x509_certificate(pki.ca_crt.read_bytes()).subject
    key, cert = _leaf(pki, ca_key, ca_name, f"system:node:{node}", ("system:nodes",), ExtendedKeyUsageOID.CLIENT_AUTH)
    _write_key(key_path, key)
    _write_cert(crt, cert)

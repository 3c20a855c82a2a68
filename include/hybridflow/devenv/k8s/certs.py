"""Certificates of a local control plane: its own CA, the API server's serving certificate, an admin
client certificate (group ``system:masters``), the service-account signing key pair, and serving
certificates for the webhooks of the controllers that run beside it. Made once per control-plane
folder (never committed); files are 0600 except the certificates."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = dt.timedelta(days=365)


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _load_key(path: Path) -> rsa.RSAPrivateKey:
    return serialization.load_pem_private_key(path.read_bytes(), password=None)


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _builder(subject: x509.Name, issuer: x509.Name, key: rsa.RSAPrivateKey) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALID))


def ensure_pki(dir: Path, *, server_names: tuple[str, ...] = ()) -> Pki:
    """The control plane's PKI under ``dir``, made if missing and kept otherwise (a restarted control
    plane keeps its identity, so kubeconfigs written earlier stay valid)."""
    pki = Pki(dir)
    dir.mkdir(parents=True, exist_ok=True)
    if not pki.ca_crt.is_file():
        ca_key = _new_key()
        cert = (_builder(_name("hybridflow-local-ca"), _name("hybridflow-local-ca"), ca_key)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(ca_key, hashes.SHA256()))
        _write_key(pki.ca_key, ca_key)
        pki.ca_crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if not pki.sa_key.is_file():
        sa = _new_key()
        pki.sa_pub.write_bytes(sa.public_key().public_bytes(serialization.Encoding.PEM,
                                                            serialization.PublicFormat.SubjectPublicKeyInfo))
        _write_key(pki.sa_key, sa)
    names = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local", *server_names)
    issue(pki, "apiserver", cn="kube-apiserver", dns=names, ips=("127.0.0.1", "10.96.0.1"), server=True)
    issue(pki, "admin", cn="hybridflow-admin", org="system:masters", client=True)
    return pki


def issue(pki: Pki, name: str, *, cn: str, org: str | None = None, dns: tuple[str, ...] = (),
          ips: tuple[str, ...] = (), server: bool = False, client: bool = False) -> tuple[Path, Path]:
    """A leaf certificate signed by the PKI's CA, written as ``<name>.crt``/``<name>.key`` unless present."""
    crt, key_path = pki.crt(name), pki.key(name)
    if crt.is_file() and key_path.is_file():
        return crt, key_path
    ca_key = _load_key(pki.ca_key)
    ca = x509.load_pem_x509_certificate(pki.ca_crt.read_bytes())
    key = _new_key()
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    builder = (_builder(_name(cn, org), ca.subject, key)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if dns or ips:
        sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_key(key_path, key)
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return crt, key_path

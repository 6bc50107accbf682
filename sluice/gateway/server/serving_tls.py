"""TLS on the picker's gRPC server, as GIE's reference EPP serves it (`--secure-serving`).

Policy:
* `cert_path`: a folder holding `tls.crt` and `tls.key` (a Kubernetes TLS Secret's keys). The
  files are read again whenever they change, checked at each new connection's handshake, so a
  renewed Secret (cert-manager) is served without a restart; a pair that fails to load keeps
  the previous one (logged).
* No `cert_path`: a self-signed certificate made at start (P-256, one year), for Gateways
  that encrypt without verifying, as the reference EPP does.
* `client_ca_file`: mutual TLS. A client must present a certificate that CA signed, or the
  handshake fails before any ext_proc or EDS message is read.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("sluice.gateway.epp.tls")
CERT_FILE, KEY_FILE = "tls.crt", "tls.key"


@dataclass(frozen=True)
class ServingTls:
    cert_path: str | None = None  # folder with tls.crt + tls.key; None: self-signed
    client_ca_file: str | None = None  # require client certificates signed by this CA


def self_signed(names: list[str]) -> tuple[bytes, bytes]:
    """(certificate, key) PEM for `names` (DNS names or IP addresses), valid for a year."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM,
                              serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


class _Files:
    """The certificate pair in `folder`, loaded again when either file changes."""

    def __init__(self, folder: str, client_ca: bytes | None) -> None:
        self.cert, self.key = Path(folder) / CERT_FILE, Path(folder) / KEY_FILE
        self.client_ca = client_ca
        self.stamp: tuple[float, float] | None = None

    def _stamp(self) -> tuple[float, float] | None:
        try:
            return self.cert.stat().st_mtime, self.key.stat().st_mtime
        except OSError:
            return None

    def configuration(self):
        """A new server certificate configuration when the files changed, else None."""
        stamp = self._stamp()
        if stamp is None or stamp == self.stamp:
            return None
        try:
            pair = (self.key.read_bytes(), self.cert.read_bytes())
        except OSError as err:
            log.warning("cannot read the serving certificate (%s); keeping the previous", err)
            return None
        self.stamp = stamp
        log.info("serving certificate loaded from %s", self.cert)
        return grpc.ssl_server_certificate_configuration(
            [pair], root_certificates=self.client_ca)


def server_credentials(cfg: ServingTls) -> grpc.ServerCredentials:
    """The credentials `add_secure_port` takes for `cfg` (OSError: unreadable files)."""
    client_ca = Path(cfg.client_ca_file).read_bytes() if cfg.client_ca_file else None
    mutual = client_ca is not None
    if cfg.cert_path is None:
        cert, key = self_signed(["localhost", socket.gethostname(), "127.0.0.1"])
        log.info("serving a self-signed certificate (no --cert-path)")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                           require_client_auth=mutual)
    files = _Files(cfg.cert_path, client_ca)
    first = files.configuration()
    if first is None:
        raise OSError(f"no {CERT_FILE} and {KEY_FILE} in {cfg.cert_path}")
    return grpc.dynamic_ssl_server_credentials(first, files.configuration,
                                               require_client_authentication=mutual)


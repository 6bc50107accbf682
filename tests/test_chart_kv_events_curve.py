"""The chart's CURVE keys for the engines' KV-event sockets, end to end from the rendered chart:
its hook Job's program makes the two Secrets on a real kube-apiserver (logged in as the hook's
ServiceAccount, with the chart's hook Roles: RBAC judges it), the operator renders engine pods
from the chart's operator flags, and real pyzmq sockets take each side's keys from the Secret
its pod mounts. A replay request without the picker's key gets nothing."""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import pathlib
import secrets as tokens
import tempfile
import time

import pytest
import yaml
import zmq
from kube_api import ControlPlane, control_plane
from kube_chart import apply, denied, is_hook, requests_by, username
from kubernetes_asyncio import client as k8s
from test_chart import CHART, render

from sluice import kube_config
from sluice import zmq_curve_secrets as hook
from sluice.engine.kv_publisher import KVEventPublisher
from sluice.gateway.events.sockets import connect
from sluice.kv_events import BlockStored, decode_batch
from sluice.operator import cli as operator_cli
from sluice.operator.render import render_pool
from sluice.operator.spec import PoolSpec
from sluice.zmq_curve import ENGINE_FILES, PICKER_FILES, ZmqSecurity, init

SECRET_PROMPT = [4242, 1337, 9001, 7]  # "my password is ..." as token ids
HOOK = "helm.sh/hook"


def _one(manifests, kind, suffix):
    (found,) = [m for m in manifests if m["kind"] == kind
                and m["metadata"]["name"].endswith(suffix)]
    return found


def _container_args(manifest) -> list[str]:
    return manifest["spec"]["template"]["spec"]["containers"][0]["args"]


def _ensure_events(api, args) -> str:
    return hook.ensure(api, args.engines, args.picker, dict(args.label))


RELEASE_NS = "sluice"  # where the tests render the chart (test_chart.render)


@functools.cache
def _hook_identity() -> tuple[str, list[dict]]:
    """The hook's ServiceAccount name and its Roles' rules, as the chart renders them."""
    manifests = [m for m in render() if is_hook(m)]
    (sa,) = [m["metadata"]["name"] for m in manifests if m["kind"] == "ServiceAccount"]
    (rules,) = [m["rules"] for m in manifests if m["kind"] == "Role"]
    return sa, rules


def run_hook(job_args: list[str], secrets: dict | None = None, ensure=_ensure_events,
             plane: ControlPlane | None = None) -> tuple[str, dict]:
    """The hook Job's program (its `ensure` part: the KV-event pairs by default), with the
    Job's own arguments, on the real API server `plane` (without one: a control plane of
    its own for the call) holding `secrets` ((namespace, name) -> Secret); what it answered,
    and the Secrets after. It runs as the chart's hook ServiceAccount, with the chart's hook
    Role in each namespace it names, and no request of it may be refused. Each namespace it
    names is a fresh one on the server (the tests share it), mapped back in what it returns."""
    if plane is None:
        with (tempfile.TemporaryDirectory() as root,
              control_plane(pathlib.Path(root)) as own):
            return run_hook(job_args, secrets, ensure, own)
    args = hook.parse_args(job_args)
    secrets = secrets or {}
    named = {RELEASE_NS, *(ns for ns, _ in secrets),
             *(r.namespace for r in [*args.engines, *args.kv_transfer, args.picker] if r)}
    real = {ns: f"{ns}-{tokens.token_hex(3)}" for ns in sorted(named)}
    back = {v: k for k, v in real.items()}

    def moved(ref: hook.SecretRef | None) -> hook.SecretRef | None:
        return ref and hook.SecretRef(real[ref.namespace], ref.name)
    args.engines = [moved(r) for r in args.engines]
    args.kv_transfer = [moved(r) for r in args.kv_transfer]
    args.picker = moved(args.picker)
    sa, rules = _hook_identity()
    rbac = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
            for ns in real.values()]
    rbac.append({"apiVersion": "v1", "kind": "ServiceAccount",
                 "metadata": {"name": sa, "namespace": real[RELEASE_NS]}})
    for ns in real.values():
        meta = {"name": sa, "namespace": ns}
        rbac += [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                  "metadata": meta, "rules": rules},
                 {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                  "metadata": meta, "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                                "kind": "Role", "name": sa},
                  "subjects": [{"kind": "ServiceAccount", "name": sa,
                                "namespace": real[RELEASE_NS]}]}]
    try:
        apply(plane, rbac)
        for (ns, name), body in secrets.items():
            plane.request("POST", f"/api/v1/namespaces/{real[ns]}/secrets", {
                "apiVersion": "v1", "kind": "Secret", "type": body.get("type", "Opaque"),
                "metadata": {"name": name, "namespace": real[ns],
                             "labels": body["metadata"].get("labels") or {}},
                "data": body["data"]})
        kubeconfig = plane.kubeconfig(plane.token_for(real[RELEASE_NS], sa),
                                      f"hook-{real[RELEASE_NS]}")

        async def call() -> str:
            async with k8s.ApiClient(await kube_config.load(kubeconfig)) as api_client:
                try:
                    return await ensure(k8s.CoreV1Api(api_client), args)
                except hook.BrokenPair as err:
                    return f"broken: {err}"
        what = asyncio.run(call())
        for ns, name in back.items():  # its words name the namespaces it was given
            what = what.replace(f"{ns}/", f"{name}/")
        refused = denied(requests_by(plane, username(real[RELEASE_NS], sa)))
        assert refused == [], f"requests the chart's hook Roles refused: {refused}"
        after = {(back[ns], s["metadata"]["name"]): s for ns in real.values()
                 for s in plane.request("GET", f"/api/v1/namespaces/{ns}/secrets")["items"]}
        return what, after
    finally:
        for ns in real.values():
            plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def chart():
    return render()


@pytest.fixture(scope="module")
def made(chart, kube_plane):
    """The Secrets the rendered hook Job makes in an empty cluster."""
    what, secrets = run_hook(_container_args(_one(chart, "Job", "-kv-events-keys")),
                             plane=kube_plane)
    assert what == "created"
    return secrets


def engine_pods(chart, pool_file: str) -> list[dict]:
    """The engine Deployments the chart's operator renders (its own flags) for an example."""
    op = _one(chart, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    operator_cli.add_arguments(parser)
    config = operator_cli.config_from_args(parser.parse_args(op["args"][1:])).render
    body = yaml.safe_load((CHART / "examples" / pool_file).read_text())
    body["metadata"].update(namespace="sluice", uid="u-1")
    return [m for m in render_pool(PoolSpec.from_body(body), config)
            if m["kind"] == "Deployment"]


def mounted_curve_dir(deployment: dict, secrets: dict, dest: pathlib.Path) -> pathlib.Path:
    """The folder the container's --kv-events-curve-dir names, filled as the kubelet would
    from the Secret volume mounted there (the Secret in the pod's namespace)."""
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    path = next((a.split("=", 1)[1] for a in args if a.startswith("--kv-events-curve-dir=")),
                None) or args[args.index("--kv-events-curve-dir") + 1]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == path)
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    secret = secrets[deployment["metadata"]["namespace"], volume["secret"]["secretName"]]
    dest.mkdir(parents=True)
    for name, value in secret["data"].items():
        (dest / name).write_bytes(base64.b64decode(value))
    return dest


def replay(sock: zmq.Socket, timeout_s: float) -> list[list[bytes]]:
    """Ask for every batch from seq 0; the frames that came back within `timeout_s`."""
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    frames: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            frames.append(sock.recv_multipart())
            if frames[-1][1] == b"\xff" * 8:  # the end of the replay
                break
    return frames


def test_the_hook_makes_one_pair_split_by_side_and_keeps_it(chart, made, kube_plane):
    job = _one(chart, "Job", "-kv-events-keys")
    engines = made["sluice", "rel-sluice-kv-events-engines"]
    picker = made["sluice", "rel-sluice-kv-events-picker"]
    # each side only its own secret half: an engine cannot act as the picker
    assert sorted(engines["data"]) == sorted(ENGINE_FILES)
    assert sorted(picker["data"]) == sorted(PICKER_FILES)
    assert engines["metadata"]["labels"] == {"app.kubernetes.io/part-of": "sluice",
                                             "app.kubernetes.io/instance": "rel"}
    # an upgrade's run changes nothing
    what, after = run_hook(_container_args(job), made, plane=kube_plane)
    assert what == "kept"
    assert {k: s["data"] for k, s in after.items()} == {k: s["data"] for k, s in made.items()}
    # one of the pair deleted: no new keys that running pods would not match
    what, after = run_hook(_container_args(job), {k: made[k] for k in [
        ("sluice", "rel-sluice-kv-events-engines")]}, plane=kube_plane)
    assert what.startswith("broken:") and "picker's Secret is missing" in what
    assert "Delete sluice/rel-sluice-kv-events-engines to make a new pair" in what
    assert list(after) == [("sluice", "rel-sluice-kv-events-engines")]


def test_a_newly_watched_namespace_gets_a_copy_of_the_engines_keys(made, kube_plane):
    """An upgrade that adds a pools' namespace: its engines get the same pair."""
    grown = render("watchNamespaces={sluice,team-a}")
    what, after = run_hook(_container_args(_one(grown, "Job", "-kv-events-keys")), made,
                           plane=kube_plane)
    assert what == "kept, copied to team-a/rel-sluice-kv-events-engines"
    assert after["team-a", "rel-sluice-kv-events-engines"]["data"] == \
        made["sluice", "rel-sluice-kv-events-engines"]["data"]
    assert after["sluice", "rel-sluice-kv-events-picker"]["data"] == \
        made["sluice", "rel-sluice-kv-events-picker"]["data"]
    # pools moved out of the release namespace: the copy there is the source
    moved = render("watchNamespaces={team-b}")
    what, after = run_hook(_container_args(_one(moved, "Job", "-kv-events-keys")), made,
                           plane=kube_plane)
    assert what == "kept, copied to team-b/rel-sluice-kv-events-engines"
    assert after["team-b", "rel-sluice-kv-events-engines"]["data"] == \
        made["sluice", "rel-sluice-kv-events-engines"]["data"]
    other = {"metadata": {"name": "rel-sluice-kv-events-engines", "namespace": "team-a"},
             "data": {"server.key": "eA=="}}
    what, _ = run_hook(_container_args(_one(grown, "Job", "-kv-events-keys")),
                       {**made, ("team-a", "rel-sluice-kv-events-engines"): other},
                       plane=kube_plane)
    assert what.startswith("broken:") and "engines' Secrets differ" in what


def test_a_replay_without_the_curve_key_gets_nothing(chart, made, tmp_path):
    """The engine and the picker as the chart and its operator deploy them, each with the
    folder its pod mounts; a client without the picker's key gets no stored prompt."""
    (engine,) = engine_pods(chart, "pool-cpu.yaml")
    engine_dir = mounted_curve_dir(engine, made, tmp_path / "engine")
    picker_dir = mounted_curve_dir(_one(chart, "Deployment", "-picker"), made,
                                   tmp_path / "picker")
    pub = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv@pod@m",
                           security=ZmqSecurity(str(engine_dir)))
    ctx = zmq.Context()
    try:
        pub.publish([BlockStored(block_hashes=[1], parent_block_hash=None,
                                 token_ids=SECRET_PROMPT, block_size=4, lora_id=None,
                                 medium="CPU", lora_name=None)])
        replay_at = pub.last_replay_endpoint
        picker = connect(ctx, zmq.DEALER, replay_at, ZmqSecurity(str(picker_dir)))
        deadline = time.monotonic() + 10
        frames: list[list[bytes]] = []
        while not frames and time.monotonic() < deadline:  # (until the batch is stored)
            frames = [f for f in replay(picker, 1.0) if f[1] != b"\xff" * 8]
        assert decode_batch(frames[0][2]).events[0].token_ids == SECRET_PROMPT
        # the stored batch is there: a plain client, and a CURVE client with a key of its
        # own that knows the engines' public key, get nothing back
        assert replay(connect(ctx, zmq.DEALER, replay_at), 1.5) == []
        init(str(tmp_path / "rogue"))
        rogue = ctx.socket(zmq.DEALER)
        rogue.linger = 0
        ZmqSecurity(str(tmp_path / "rogue")).as_client(rogue)
        rogue.curve_serverkey = zmq.auth.load_certificate(str(picker_dir / "server.key"))[0]
        rogue.connect(replay_at)
        assert replay(rogue, 1.5) == []
        # and the engine's own folder holds no client secret to try with
        with pytest.raises(OSError):
            ZmqSecurity(str(engine_dir)).as_client(ctx.socket(zmq.DEALER))
    finally:
        ctx.destroy(linger=0)
        pub.close()


def test_vllm_pools_stay_plain_and_the_switch_turns_curve_off(chart):
    (vllm,) = engine_pods(chart, "pool-vllm-gpu.yaml")
    pod = vllm["spec"]["template"]["spec"]
    assert not any("curve" in a for a in pod["containers"][0]["args"])
    assert not any(v["name"] == "kv-events-curve" for v in pod["volumes"])
    off = render("kvEventsCurve.enabled=false")
    # (the hook Job still runs for the KV-transfer keys: test_chart_kv_transfer_curve.py)
    assert not any("--engines" in a or "--picker" in a
                   for a in _container_args(_one(off, "Job", "-kv-events-keys")))
    both_off = render("kvEventsCurve.enabled=false", "kvTransferCurve.enabled=false")
    assert not any(m["kind"] == "Job" or "kv-events" in m["metadata"]["name"]
                   for m in both_off)
    assert not any("curve" in a for a in _container_args(_one(off, "Deployment", "-picker")))
    assert not any("kv-events-curve" in a
                   for a in _container_args(_one(off, "Deployment", "-operator")))
    (sluice_engine,) = engine_pods(off, "pool-cpu.yaml")
    assert not any("curve" in a for a in _container_args(sluice_engine))


def test_the_hook_is_a_pre_install_job_with_a_short_lived_least_privilege_role():
    manifests = render("watchNamespaces={team-a,team-b}")
    hooks = [m for m in manifests if HOOK in m["metadata"].get("annotations", {})]
    assert sorted((m["kind"], m["metadata"]["namespace"]) for m in hooks) == [
        ("Job", "sluice"), ("Role", "sluice"), ("Role", "team-a"), ("Role", "team-b"),
        ("RoleBinding", "sluice"), ("RoleBinding", "team-a"), ("RoleBinding", "team-b"),
        ("ServiceAccount", "sluice")]
    for m in hooks:
        annotations = m["metadata"]["annotations"]
        assert annotations[HOOK] == "pre-install,pre-upgrade"
        assert annotations["helm.sh/hook-delete-policy"] == \
            "before-hook-creation,hook-succeeded"
        # the ServiceAccount and its Roles exist before the Job runs
        assert int(annotations["helm.sh/hook-weight"]) == (-5 if m["kind"] == "Job" else -10)
    names = ["rel-sluice-kv-events-engines", "rel-sluice-kv-events-picker",
             "rel-sluice-kv-transfer-keys"]
    for role in (m for m in hooks if m["kind"] == "Role"):
        assert role["rules"] == [
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": names,
             "verbs": ["get"]}]
    job = next(m for m in hooks if m["kind"] == "Job")
    assert _container_args(job)[:3] == ["--engines=team-a/rel-sluice-kv-events-engines",
                                        "--engines=team-b/rel-sluice-kv-events-engines",
                                        "--picker=sluice/rel-sluice-kv-events-picker"]
    pod = job["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

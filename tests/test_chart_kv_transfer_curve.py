"""The chart's CURVE keys for prefill/decode pools' KV-transfer sockets, from the rendered
chart: its hook Job's program makes one Secret per pools' namespace (in an emulated API
server), the operator renders the disaggregated example from the chart's operator flags, each
role mounts its half, and real pyzmq sockets set up as the transport sets them (a ROUTER
CURVE server with a ZAP handler, DEALER clients) take their keys from those mounts: the
decode engine's half is answered, a client with a key of its own is not. (The transport
itself with these halves: tests/test_kv_transfer.py; no torch here.)"""

from __future__ import annotations

import base64
import json
import pathlib

import pytest
import zmq
from test_chart import render
from test_chart_kv_events_curve import _container_args, _one, engine_pods, run_hook

from sluice import zmq_curve_secrets as hook
from sluice.operator.render import KV_TRANSFER_CURVE_FILES
from sluice.zmq_curve import ENGINE_FILES, PICKER_FILES, ZmqSecurity, init

SECRET = "rel-sluice-kv-transfer-keys"


def run_transfer_hook(plane, job_args: list[str], secrets: dict | None = None
                      ) -> tuple[str, dict]:
    """The hook Job's KV-transfer part (`run_hook` with `hook.ensure_transfer`) on the
    API server `plane`; what it answered, and the transfer Secrets after."""
    what, after = run_hook(job_args, secrets, lambda api, args: hook.ensure_transfer(
        api, args.kv_transfer, dict(args.label)), plane=plane)
    return what, {k: v for k, v in after.items() if k[1] == SECRET}


@pytest.fixture(scope="module")
def chart():
    return render()


def test_role_halves_are_the_curve_sides():
    # prefill engines serve blocks (CURVE server), decode engines pull them (client)
    assert KV_TRANSFER_CURVE_FILES == {"prefill": ENGINE_FILES, "decode": PICKER_FILES}


def test_the_hook_makes_a_pair_per_pools_namespace_and_keeps_it(kube_plane):
    job = _one(render("watchNamespaces={team-a,team-b}"), "Job", "-kv-events-keys")
    args = _container_args(job)
    assert [a for a in args if a.startswith("--kv-transfer")] == [
        f"--kv-transfer=team-a/{SECRET}", f"--kv-transfer=team-b/{SECRET}"]
    what, made = run_transfer_hook(kube_plane, args)
    assert what == f"created team-a/{SECRET}, team-b/{SECRET}"
    a, b = made["team-a", SECRET], made["team-b", SECRET]
    assert sorted(a["data"]) == sorted(ENGINE_FILES + PICKER_FILES)
    assert a["data"]["server.key_secret"] != b["data"]["server.key_secret"]  # a pair each
    assert a["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"
    what, after = run_transfer_hook(kube_plane, args, made)  # an upgrade: nothing changes
    assert what == f"kept team-a/{SECRET}, team-b/{SECRET}"
    assert {k: s["data"] for k, s in after.items()} == {k: s["data"] for k, s in made.items()}
    broken = {**made, ("team-a", SECRET): {
        "metadata": {"name": SECRET, "namespace": "team-a"}, "data": {"server.key": "eA=="}}}
    what, _ = run_transfer_hook(kube_plane, args, broken)
    assert what.startswith("broken:") and "lack client.key" in what and "Delete team-a/" in what


def _mounted_half(deployment: dict, secret: dict, dest: pathlib.Path) -> pathlib.Path:
    """The folder the engine's --kv-transfer-config names as curve_dir, filled as the kubelet
    would from the Secret volume mounted there (only the volume's items)."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    path = config["kv_connector_extra_config"]["curve_dir"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == path)
    assert mount["readOnly"] is True
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == SECRET
    dest.mkdir(parents=True)
    for item in volume["secret"]["items"]:
        (dest / item["path"]).write_bytes(base64.b64decode(secret["data"][item["key"]]))
    return dest




def test_only_the_decode_engines_half_is_served(kube_plane, chart, tmp_path):
    _, made = run_transfer_hook(kube_plane, _container_args(_one(chart, "Job", "-kv-events-keys")))
    secret = made["sluice", SECRET]
    pods = {d["metadata"]["name"]: d for d in engine_pods(chart, "pool-disaggregated.yaml")}
    prefill = _mounted_half(pods["qwen3-pd-prefill"], secret, tmp_path / "prefill")
    decode = _mounted_half(pods["qwen3-pd-decode"], secret, tmp_path / "decode")
    assert sorted(p.name for p in prefill.iterdir()) == sorted(ENGINE_FILES)
    assert sorted(p.name for p in decode.iterdir()) == sorted(PICKER_FILES)
    ctx = zmq.Context()
    server_security = ZmqSecurity(str(prefill))
    auth = server_security.authenticator(ctx)
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    server_security.as_server(server)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    try:
        def client(security: ZmqSecurity | None, server_key: bytes | None = None) -> zmq.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            if security is not None:
                security.as_client(sock)
            if server_key is not None:
                sock.curve_serverkey = server_key
            sock.connect(f"tcp://127.0.0.1:{port}")
            return sock

        good = client(ZmqSecurity(str(decode)))
        good.send(b"pull")
        assert server.poll(10_000)
        _, body = server.recv_multipart()
        assert body == b"pull"
        # a plain client, and a CURVE client with its own key that knows the server's
        # public key, never reach the server
        init(str(tmp_path / "rogue"))
        server_key = zmq.auth.load_certificate(str(decode / "server.key"))[0]
        client(None).send(b"pull")
        client(ZmqSecurity(str(tmp_path / "rogue")), server_key).send(b"pull")
        assert not server.poll(1500)
        # neither half can act as the other side
        with pytest.raises(OSError):
            ZmqSecurity(str(prefill)).as_client(ctx.socket(zmq.DEALER))
        with pytest.raises(OSError):
            ZmqSecurity(str(decode)).as_server(ctx.socket(zmq.ROUTER))
    finally:
        auth.stop()
        ctx.destroy(linger=0)


def test_aggregated_and_vllm_pools_and_the_switch_stay_plain(chart):
    for pool_file in ("pool-cpu.yaml", "pool-vllm-gpu.yaml"):
        for d in engine_pods(chart, pool_file):
            pod = d["spec"]["template"]["spec"]
            assert not any(v["name"] == "kv-transfer-curve" for v in pod["volumes"])
            assert not any("kv-transfer-curve" in a for a in pod["containers"][0]["args"])
    off = render("kvTransferCurve.enabled=false")
    assert not any("kv-transfer" in a for a in _container_args(_one(off, "Job", "-kv-events-keys")))
    assert not any("kv-transfer" in a
                   for a in _container_args(_one(off, "Deployment", "-operator")))
    for d in engine_pods(off, "pool-disaggregated.yaml"):
        assert "curve_dir" not in " ".join(_container_args(d))
    # KV-event CURVE off alone: the Job still makes the transfer keys, and only those
    only = _container_args(_one(render("kvEventsCurve.enabled=false"), "Job", "-kv-events-keys"))
    assert [a.split("=")[0] for a in only if not a.startswith("--label")] == ["--kv-transfer"]

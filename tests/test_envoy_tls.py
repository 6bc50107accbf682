"""Downstream TLS on the gateway's Envoy (`sluice/gateway/envoy/tls.py`): real Envoy, the stub
picker and engines of test_envoy_dataplane.py, an HTTPS client that verifies the certificate
(self-signed here, made with the openssl CLI), and a renewal as a Kubernetes Secret volume
delivers one, served without a restart."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import ssl
import subprocess
import time

import httpx
import pytest
import yaml
from test_envoy_dataplane import Stubs

from sluice.gateway.envoy import bootstrap, tls
from sluice.gateway.envoy.bootstrap import EnvoyConfig
from sluice.gateway.envoy.process import EnvoyProcess, find_envoy

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def make_cert(folder: pathlib.Path, cn: str) -> tuple[bytes, bytes]:
    """A self-signed certificate for localhost and 127.0.0.1: (cert PEM, key PEM)."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / f"{cn}.crt", folder / f"{cn}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj", f"/CN={cn}",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=30)
    return cert.read_bytes(), key.read_bytes()


def kubelet_update(folder: pathlib.Path, files: dict[str, bytes]) -> None:
    """Write `files` as the kubelet updates a Secret volume: into a new hidden folder, then
    one rename of the `..data` symlink onto it; each name links through `..data`."""
    folder.mkdir(parents=True, exist_ok=True)
    version = folder / f"..{time.time_ns()}"
    version.mkdir()
    for name, data in files.items():
        (version / name).write_bytes(data)
    (folder / "..data_tmp").symlink_to(version.name)
    os.replace(folder / "..data_tmp", folder / "..data")
    for name in files:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")


def served_cert(port: int, alpn: list[str] | None = None) -> tuple[bytes, str | None, str]:
    """(DER certificate, ALPN protocol, TLS version) of a handshake with 127.0.0.1:port."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # (only reading what it serves)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as s:
        return s.getpeercert(binary_form=True), s.selected_alpn_protocol(), s.version()


def pem_to_der(pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.decode())


@pytest.fixture(scope="module")
def stubs():
    s = Stubs()
    yield s
    s.close()


def _config(stubs: Stubs, folder: pathlib.Path) -> EnvoyConfig:
    return EnvoyConfig(listen_host="127.0.0.1", listen_port=0, admin_port=0,
                       picker_port=stubs.picker_port, tls_cert_file=str(folder / "tls.crt"),
                       tls_key_file=str(folder / "tls.key"))


def test_the_bootstrap_cli_writes_the_sds_file_and_envoy_accepts_both(tmp_path):
    cert, key = make_cert(tmp_path / "made", "localhost")
    kubelet_update(tmp_path / "tls", {"tls.crt": cert, "tls.key": key})
    out = tmp_path / "etc" / "envoy.yaml"
    out.parent.mkdir()
    bootstrap.main(["--tls-cert-file", str(tmp_path / "tls/tls.crt"),
                    "--tls-key-file", str(tmp_path / "tls/tls.key"), "--out", str(out)])
    config = yaml.safe_load(out.read_text())
    socket_ = config["static_resources"]["listeners"][0]["filter_chains"][0]["transport_socket"]
    context = socket_["typed_config"]["common_tls_context"]
    assert context["alpn_protocols"] == ["h2", "http/1.1"]
    assert context["tls_params"]["tls_minimum_protocol_version"] == "TLSv1_2"
    sds_path = context["tls_certificate_sds_secret_configs"][0]["sds_config"][
        "path_config_source"]["path"]
    assert sds_path == str(tmp_path / "etc" / tls.SDS_FILE)
    (secret,) = yaml.safe_load(pathlib.Path(sds_path).read_text())["resources"]
    assert secret["tls_certificate"]["watched_directory"] == {"path": str(tmp_path / "tls")}
    check = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(out)],
                           capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    with pytest.raises(ValueError, match="together"):
        bootstrap.render_bootstrap(EnvoyConfig(tls_cert_file="/x/tls.crt"))
    with pytest.raises(SystemExit, match="--out"):
        bootstrap.main(["--tls-cert-file", "/x/tls.crt", "--tls-key-file", "/x/tls.key"])
    plain = bootstrap.render_bootstrap(EnvoyConfig())
    assert "transport_socket" not in plain["static_resources"]["listeners"][0][
        "filter_chains"][0]


def test_https_through_the_gateway_and_no_plain_http(stubs, tmp_path):
    cert, key = make_cert(tmp_path / "made", "localhost")
    kubelet_update(tmp_path / "tls", {"tls.crt": cert, "tls.key": key})
    (tmp_path / "ca.pem").write_bytes(cert)
    engine = stubs.engines[0]
    with EnvoyProcess(_config(stubs, tmp_path / "tls"), concurrency=1) as envoy:
        verify = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        with httpx.Client(verify=verify, timeout=10) as client:
            reply = client.post(f"https://localhost:{envoy.listen_port}/v1/echo",
                                content=b'{"prompt": "hi"}',
                                headers={"x-test-id": "tls-1", "x-test-pick": engine.endpoint})
        assert reply.status_code == 200 and reply.json()["engine"] == engine.name
        # Envoy tells the engine the client came over https
        _, seen = stubs.events.when("tls-1", "engine_request")
        assert seen["headers"]["x-forwarded-proto"] == "https"
        _, alpn, version = served_cert(envoy.listen_port, ["h2", "http/1.1"])
        assert alpn == "h2" and version in ("TLSv1.2", "TLSv1.3")
        # a client that does not trust the certificate is refused by its own TLS
        with httpx.Client(timeout=10) as client, pytest.raises(httpx.ConnectError):
            client.get(f"https://localhost:{envoy.listen_port}/v1/echo")
        # plain HTTP on the TLS port gets no HTTP answer
        with socket.create_connection(("127.0.0.1", envoy.listen_port), timeout=5) as s:
            s.sendall(b"GET /v1/echo HTTP/1.1\r\nhost: x\r\n\r\n")
            try:
                answer = s.recv(100)
            except ConnectionResetError:
                answer = b""
        assert not answer.startswith(b"HTTP/")


def test_a_renewed_certificate_is_served_without_a_restart(stubs, tmp_path):
    """A renewal (cert-manager's, through the kubelet's Secret volume) reaches new
    connections: Envoy watches the folder through SDS."""
    old = make_cert(tmp_path / "made", "old")
    new = make_cert(tmp_path / "made", "new")
    kubelet_update(tmp_path / "tls", {"tls.crt": old[0], "tls.key": old[1]})
    with EnvoyProcess(_config(stubs, tmp_path / "tls"), concurrency=1) as envoy:
        pid = envoy.proc.pid
        assert served_cert(envoy.listen_port)[0] == pem_to_der(old[0])
        kubelet_update(tmp_path / "tls", {"tls.crt": new[0], "tls.key": new[1]})
        deadline = time.monotonic() + 15
        while served_cert(envoy.listen_port)[0] != pem_to_der(new[0]):
            assert time.monotonic() < deadline, "the renewed certificate was not served"
            time.sleep(0.05)
        assert envoy.proc.pid == pid and envoy.proc.poll() is None


def test_sluice_up_serves_https_with_its_certificate(tmp_path):
    """`sluice up --tls-cert/--tls-key`: the stack's gateway (real picker and Envoy, a
    scripted engine) answers over HTTPS with that certificate, and not over plain HTTP."""
    from fake_engine import ThreadServer, fake_engine
    from redis_server import RedisServer

    from sluice.local.stack import LocalStack, StackConfig, free_port

    cert, _ = make_cert(tmp_path, "localhost")
    with RedisServer() as redis, ThreadServer(fake_engine("ok", {"model": "m"})) as engine:
        stack = LocalStack(StackConfig(
            port=free_port(), redis_url=redis.url, routing="round_robin",
            engine_args=("--load-format", "dummy"),  # (no tokenizer for the picker to load)
            tls_cert=str(tmp_path / "localhost.crt"), tls_key=str(tmp_path / "localhost.key")))
        stack.engine_urls, stack.engine_specs = [engine.url], [f"{engine.url},model=m"]
        try:
            stack.start_gateway("round_robin")  # (its readiness check is over HTTPS)
            assert stack.url.startswith("https://")
            verify = ssl.create_default_context(cafile=str(tmp_path / "localhost.crt"))
            port = stack.url.rsplit(":", 1)[1]
            reply = httpx.post(f"https://localhost:{port}/v1/completions", verify=verify,
                               json={"model": "m", "prompt": "hi"}, timeout=30)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "hello"
            assert served_cert(int(port))[0] == pem_to_der(cert)
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        finally:
            stack.stop()
    with pytest.raises(FileNotFoundError, match="TLS: no file"):
        LocalStack(StackConfig(tls_cert=str(tmp_path / "none.crt"),
                               tls_key=str(tmp_path / "none.key")))._tls_files()

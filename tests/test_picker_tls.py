"""TLS on the picker's gRPC server (`--secure-serving`) behind a real Envoy: self-signed,
a verified certificate from files that is served anew after a renewal, mutual TLS that
leaves a client without a certificate no answer, and plaintext health for kubelet."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys

import grpc
import openai
import pytest
from engine_server import free_port
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from fake_engine import ThreadServer as Server
from fake_engine import fake_engine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kube_pki import make_ca, signed
from picker_harness import Front, PickerThread, headers, static_core, wait_for

from sluice.gateway.server.serving_tls import CERT_FILE, KEY_FILE, ServingTls

SAN = "subjectAltName=DNS:localhost,IP:127.0.0.1"


@pytest.fixture
def pki(tmp_path):
    """A CA; the picker's pair in serving/ (as a TLS Secret mounts it); Envoy's client pair."""
    make_ca(tmp_path)
    signed(tmp_path, "picker", "/CN=picker", SAN)
    signed(tmp_path, "envoy", "/CN=envoy")
    serving = tmp_path / "serving"
    serving.mkdir()
    shutil.copy(tmp_path / "picker.crt", serving / CERT_FILE)
    shutil.copy(tmp_path / "picker.key", serving / KEY_FILE)
    return tmp_path


def complete(front: Front) -> str:
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    return client.completions.create(model="m", prompt="hi", max_tokens=1).choices[0].text


def served_certificate(port: int) -> bytes:
    """The DER certificate the picker presents (no verification: only read)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with context.wrap_socket(socket.create_connection(("127.0.0.1", port)),
                             server_hostname="localhost") as tls:
        return tls.getpeercert(binary_form=True)


def test_self_signed_picker_behind_envoy():
    with Server(fake_engine("ok", {})) as up:
        gw = static_core([up.port])
        with Front(gw, tls=ServingTls(), picker_tls=True) as front:
            wait_for(lambda: len(gw.registry.active()) == 1)
            assert complete(front)
            # the stream really is TLS: a plaintext client gets nothing from that port
            with (grpc.insecure_channel(f"127.0.0.1:{front.picker.port}") as plain,
                  pytest.raises(grpc.RpcError) as err):
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_verified_certificate_is_served_anew_after_a_renewal(pki):
    with Server(fake_engine("ok", {})) as up:
        gw = static_core([up.port])
        with Front(gw, tls=ServingTls(str(pki / "serving")), picker_tls=True,
                   picker_host="127.0.0.1", picker_ca_file=str(pki / "ca.crt")) as front:
            wait_for(lambda: len(gw.registry.active()) == 1)
            assert complete(front)
            before = served_certificate(front.picker.port)
            signed(pki, "renewed", "/CN=picker", SAN)
            shutil.copy(pki / "renewed.key", pki / "serving" / KEY_FILE)
            shutil.copy(pki / "renewed.crt", pki / "serving" / CERT_FILE)
            wait_for(lambda: served_certificate(front.picker.port) != before)
            assert complete(front)  # Envoy verifies the renewed one too


def test_envoy_refuses_a_picker_its_ca_did_not_sign(pki, tmp_path):
    other = tmp_path / "other-ca"
    make_ca(other, "another-ca")
    with Server(fake_engine("ok", {})) as up:
        gw = static_core([up.port])
        with Front(gw, tls=ServingTls(str(pki / "serving")), picker_tls=True,
                   picker_host="127.0.0.1", picker_ca_file=str(other / "ca.crt"),
                   picker_health_check=False, ext_proc_message_timeout_s=1.0) as front:
            wait_for(lambda: len(gw.registry.active()) == 1)
            with pytest.raises(openai.APIStatusError) as err:
                complete(front)
            assert err.value.status_code >= 500  # no picker, no routing (fail closed)
            fails = front.envoy.stats("cluster.sluice_picker.ssl.fail_verify")
            assert sum(fails.values()) >= 1


def test_mutual_tls_answers_only_clients_with_a_certificate(pki):
    tls = ServingTls(str(pki / "serving"), client_ca_file=str(pki / "ca.crt"))
    with Server(fake_engine("ok", {})) as up:
        gw = static_core([up.port])
        with Front(gw, tls=tls, picker_tls=True, picker_host="127.0.0.1",
                   picker_ca_file=str(pki / "ca.crt"),
                   picker_client_cert_file=str(pki / "envoy.crt"),
                   picker_client_key_file=str(pki / "envoy.key")) as front:
            wait_for(lambda: len(gw.registry.active()) == 1)
            assert complete(front)
            # a client that trusts the CA but has no certificate: no ext_proc answer at all
            creds = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes())
            with grpc.secure_channel(f"127.0.0.1:{front.picker.port}", creds) as channel:
                stream = pb_grpc.ExternalProcessorStub(channel).Process(iter([
                    pb.ProcessingRequest(request_headers=headers("POST", "/v1/completions"))]),
                    timeout=5)
                with pytest.raises(grpc.RpcError) as err:
                    list(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_health_has_a_plaintext_port_of_its_own(pki):
    """kubelet's gRPC probes speak no TLS: health alone, on --grpc-health-port."""
    port = free_port()
    with (Server(fake_engine("ok", {})) as up,
          PickerThread(static_core([up.port]), tls=ServingTls(str(pki / "serving")), health_port=port),
          grpc.insecure_channel(f"127.0.0.1:{port}") as plain):
        check = health_pb2_grpc.HealthStub(plain).Check(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        stream = pb_grpc.ExternalProcessorStub(plain).Process(iter([
            pb.ProcessingRequest(request_headers=headers("POST", "/v1/completions"))]),
            timeout=5)
        with pytest.raises(grpc.RpcError) as err:  # ext_proc is not served there
            list(stream)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_cli_refuses_tls_files_without_secure_serving(tmp_path):
    run = subprocess.run([sys.executable, "-m", "sluice.cli", "epp", "--cert-path",
                          str(tmp_path), "--engine", "http://127.0.0.1:1,model=m"],
                         capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode != 0 and "need --secure-serving" in run.stderr, run.stderr

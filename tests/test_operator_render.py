"""Pure rendering: spec → desired children. No cluster, no I/O."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from sluice import labels
from sluice.operator.render import RenderConfig, render_pool, spec_hash
from sluice.operator.spec import PoolSpec, SpecError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example(name: str) -> dict:
    body = yaml.safe_load((ROOT / "charts/sluice/examples" / name).read_text())
    body["metadata"]["uid"] = "uid-1"
    return body


def _by_kind(manifests: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for m in manifests:
        out.setdefault(m["kind"], []).append(m)
    return out


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_plain_pool_renders_service_deployment_pdb_with_contract_labels():
    pool = PoolSpec.from_body(_example("pool-cpu.yaml"))
    kinds = _by_kind(render_pool(pool))
    assert sorted(kinds) == ["Deployment", "PodDisruptionBudget", "Service"]
    (dep,) = kinds["Deployment"]
    assert dep["metadata"]["name"] == "smollm2-serve"
    pod_meta = dep["spec"]["template"]["metadata"]
    assert pod_meta["labels"] == {
        "app.kubernetes.io/name": "sluice-engine", "app.kubernetes.io/instance": "smollm2",
        "app.kubernetes.io/managed-by": "sluice-operator", "sluice.dev/pool": "smollm2",
        "sluice.dev/role": "serve"}
    assert pod_meta["annotations"]["sluice.dev/model"] == "smollm2-135m-instruct"
    # selector ⊂ pod labels, otherwise the API server rejects the Deployment
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_meta["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in _container(dep)["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    svc = kinds["Service"][0]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= pod_meta["labels"].items()
    for m in render_pool(pool):
        assert m["metadata"]["ownerReferences"] == [{
            "apiVersion": "sluice.dev/v1alpha1", "kind": "InferencePool", "name": "smollm2",
            "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
        assert m["metadata"]["annotations"][labels.SPEC_HASH_ANNOTATION] == spec_hash(m)
        assert m["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "sluice-operator"


def test_sluice_engine_flags_follow_the_contract():
    pool = PoolSpec.from_body(_example("pool-cpu.yaml"))
    dep = _by_kind(render_pool(pool))["Deployment"][0]
    c = _container(dep)
    assert c["command"] == ["sluice"]
    args = c["args"]
    flag = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
    assert args[0] == "engine" and flag["--model"] == "default"
    assert flag["--served-model-name"] == "smollm2-135m-instruct"
    assert flag["--port"] == "8000" and flag["--host"] == "0.0.0.0"
    assert flag["--kv-cache-memory"] == "512MiB" and flag["--max-num-seqs"] == "64"
    assert flag["--kv-events-endpoint"] == "tcp://*:5557"
    assert flag["--kv-events-replay-endpoint"] == "tcp://*:5558"
    assert flag["--kv-events-topic"] == "kv@$(POD_IP):8000@smollm2-135m-instruct"
    assert any(e["name"] == "POD_IP" for e in c["env"])
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # still serving a while once deleted, and inside the grace period
    wait = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 5 <= wait < pod["terminationGracePeriodSeconds"]
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "20Gi"}} in pod["volumes"]
    assert c["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"},
                              "limits": {"memory": "4Gi"}}


def test_vllm_pool_publishes_kv_events_and_requests_gpus():
    pool = PoolSpec.from_body(_example("pool-vllm-gpu.yaml"))
    kinds = _by_kind(render_pool(pool, RenderConfig(vllm_image="vllm/vllm-openai:v9")))
    dep = kinds["Deployment"][0]
    c = _container(dep)
    assert c["image"] == "vllm/vllm-openai:v9"
    assert c["command"] == ["vllm", "serve"]
    args = c["args"]
    assert args[0] == "meta-llama/Llama-3.1-8B-Instruct"
    kv = json.loads(args[args.index("--kv-events-config") + 1])
    assert kv == {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                  "topic": "kv@$(POD_IP):8000@meta-llama/Llama-3.1-8B-Instruct"}
    assert "--enable-prefix-caching" in args and "--revision" in args
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
    token = next(e for e in c["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    pod = dep["spec"]["template"]["spec"]
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "initContainers" not in pod  # vLLM downloads by itself
    assert dep["spec"]["replicas"] == 2


def test_disaggregated_pool_renders_one_deployment_and_pdb_per_role():
    pool = PoolSpec.from_body(_example("pool-disaggregated.yaml"))
    kinds = _by_kind(render_pool(pool))
    deps = {d["metadata"]["name"]: d for d in kinds["Deployment"]}
    assert sorted(deps) == ["qwen3-pd-decode", "qwen3-pd-prefill"]
    assert deps["qwen3-pd-decode"]["spec"]["replicas"] == 2
    assert deps["qwen3-pd-prefill"]["spec"]["template"]["metadata"]["labels"][
        "sluice.dev/role"] == "prefill"
    assert len(kinds["PodDisruptionBudget"]) == 2 and len(kinds["Service"]) == 1
    c = _container(deps["qwen3-pd-decode"])
    assert c["args"][c["args"].index("--model") + 1] == "/models/Qwen3-0.6B"
    pod = deps["qwen3-pd-decode"]["spec"]["template"]["spec"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "models",
                                                        "readOnly": True}} in pod["volumes"]


def test_prefill_engines_produce_kv_and_decode_engines_consume_it():
    """Each role's --kv-transfer-config parses with the engine's own parser: prefill pods
    serve their blocks on the kv-transfer port at the pod IP, decode pods pull them."""
    from sluice.engine.kv_transfer.config import KVTransferConfig

    deps = {d["metadata"]["labels"]["sluice.dev/role"]: d for d in _by_kind(render_pool(
        PoolSpec.from_body(_example("pool-disaggregated.yaml"))))["Deployment"]}
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        c = _container(deps[role])
        text = c["args"][c["args"].index("--kv-transfer-config") + 1]
        assert KVTransferConfig.from_json(text).kv_role == kv_role
        config = json.loads(text)
        assert config["kv_port"] == labels.KV_TRANSFER_PORT
        assert config["kv_connector_extra_config"]["advertise_host"] == "$(POD_IP)"
        assert {"name": "kv-transfer", "containerPort": labels.KV_TRANSFER_PORT,
                "protocol": "TCP"} in c["ports"]
        assert any(e["name"] == "POD_IP" for e in c["env"])  # what $(POD_IP) expands from
    plain = _by_kind(render_pool(PoolSpec.from_body(_example("pool-cpu.yaml"))))
    assert "--kv-transfer-config" not in _container(plain["Deployment"][0])["args"]


@pytest.mark.parametrize("speculative", [
    {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMin": 1, "promptLookupMax": 3},
    {"method": "early_exit", "numSpeculativeTokens": 2, "numLayers": 12},
    {"method": "draft_model", "numSpeculativeTokens": 3, "model": "/models/draft"},
])
def test_speculative_decoding_reaches_the_engine_in_its_own_flag(speculative):
    from sluice.cli import build_parser

    body = _example("pool-cpu.yaml")
    body["spec"]["engine"]["speculative"] = speculative
    args = _container(_by_kind(render_pool(PoolSpec.from_body(body)))["Deployment"][0])["args"]
    config = build_parser(args).parse_args(args).speculative_config  # the engine's own type
    assert config.method == speculative["method"]
    assert config.num_speculative_tokens == speculative["numSpeculativeTokens"]


def test_hf_source_with_sluice_engine_downloads_in_an_init_container():
    body = _example("pool-cpu.yaml")
    body["spec"]["model"]["source"] = {"huggingFace": {"repo": "HuggingFaceTB/SmolLM2-135M"}}
    dep = _by_kind(render_pool(PoolSpec.from_body(body)))["Deployment"][0]
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    env = {e["name"]: e.get("value") for e in init["env"]}
    model = _container(dep)["args"][_container(dep)["args"].index("--model") + 1]
    assert env["SLUICE_MODEL_DIR"] == model == "/model-cache/models/HuggingFaceTB--SmolLM2-135M@main"


def test_rendering_is_pure_and_hash_tracks_changes():
    body = _example("pool-cpu.yaml")
    a = render_pool(PoolSpec.from_body(body))
    assert a == render_pool(PoolSpec.from_body(body))
    body["spec"]["engine"]["maxNumSeqs"] = 32
    b = render_pool(PoolSpec.from_body(body))
    hashes = lambda ms: [m["metadata"]["annotations"][labels.SPEC_HASH_ANNOTATION] for m in ms]
    assert hashes(a)[0] == hashes(b)[0]  # the Service did not change
    assert hashes(a)[1] != hashes(b)[1]  # the Deployment did


@pytest.mark.parametrize("mutate,message", [
    (lambda s: s.pop("replicas"), "exactly one of spec.replicas"),
    (lambda s: s["engine"].update(kind="vllm"), "needs spec.model.source"),
    (lambda s: [s.pop("replicas"), s.update(roles={"prefill": {}, "decode": {}}),
                s["engine"].update(kind="vllm"),
                s["model"].update(source={"image": {"path": "/m"}})],
     "routing sidecar on its decode pods"),
    (lambda s: s.update(autoscaling={"minReplicas": 3, "maxReplicas": 2}), "minReplicas"),
    (lambda s: s["engine"].update(speculative={"method": "draft_model",
                                               "numSpeculativeTokens": 2}), "model is required"),
])
def test_spec_errors_the_schema_also_rejects(mutate, message):
    body = _example("pool-cpu.yaml")
    mutate(body["spec"])
    with pytest.raises(SpecError, match=message):
        PoolSpec.from_body(body)


@pytest.mark.parametrize("version", ["1.30", "1.37"])
def test_rendered_children_validate_against_kubernetes(version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for name in ("pool-cpu.yaml", "pool-vllm-gpu.yaml", "pool-disaggregated.yaml"):
        for manifest in render_pool(PoolSpec.from_body(_example(name))):
            kubernetes_validate.validate(manifest, version, strict=True)


@pytest.mark.parametrize("name", ["pool-cpu.yaml", "pool-disaggregated.yaml"])
def test_rendered_sluice_args_parse_with_the_engine_cli(name):
    """Contract check against the engine's own parser (flag drift fails here)."""
    from sluice.cli import build_parser

    body = _example(name)
    dep = _by_kind(render_pool(PoolSpec.from_body(body)))["Deployment"][0]
    args = _container(dep)["args"]
    parsed = build_parser(args).parse_args(args)
    assert parsed.served_model_name == body["spec"]["model"]["name"]
    assert parsed.port == 8000 and parsed.kv_events_endpoint == "tcp://*:5557"


@pytest.mark.parametrize("example", ["pool-cpu.yaml", "pool-vllm-gpu.yaml",
                                     "pool-disaggregated.yaml"])
def test_every_engine_pod_is_restricted_with_a_read_only_root(example):
    """Pod Security's restricted profile on every container, vLLM's included; no API
    token mounted; the root filesystem read-only, caches on emptyDir / the cache volume."""
    for dep in _by_kind(render_pool(PoolSpec.from_body(_example(example))))["Deployment"]:
        pod = dep["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["readOnlyRootFilesystem"]
            mounted = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/tmp" in mounted and "/model-cache" in mounted
            env = {e["name"]: e for e in c["env"]}
            assert env["HOME"]["value"].startswith("/tmp")


def test_a_literal_hf_token_is_refused():
    body = _example("pool-cpu.yaml")
    body["spec"].setdefault("engine", {})["env"] = [{"name": "HF_TOKEN", "value": "hf_x"}]
    with pytest.raises(SpecError, match="Secret"):
        PoolSpec.from_body(body)
    body["spec"]["engine"]["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "hf", "key": "token"}}}]
    PoolSpec.from_body(body)


def test_engines_take_their_api_key_from_the_configured_secret():
    import argparse

    from sluice.operator import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    config = cli.config_from_args(p.parse_args(["--engine-api-key-secret", "engine-key:k"]))
    for example in ("pool-cpu.yaml", "pool-vllm-gpu.yaml"):
        pool = PoolSpec.from_body(_example(example))
        (dep,) = _by_kind(render_pool(pool, config.render))["Deployment"][:1]
        env = {e["name"]: e for e in _container(dep)["env"]}
        assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": "engine-key", "key": "k", "optional": True}
    plain = _by_kind(render_pool(PoolSpec.from_body(_example("pool-cpu.yaml"))))
    assert "VLLM_API_KEY" not in {e["name"] for e in _container(plain["Deployment"][0])["env"]}


@pytest.mark.parametrize("kind, engine, flags", [
    ("sluice", {"quantization": "gguf"}, ["--quantization", "gguf"]),
    ("sluice", {"kvCacheDtype": "fp8"}, ["--kv-cache-dtype", "fp8"]),
    ("vllm", {"quantization": "awq", "kvCacheDtype": "fp8"},
     ["--quantization", "awq", "--kv-cache-dtype", "fp8"]),
    ("vllm", {"kvCacheDtype": "auto"}, []),
])
def test_quantization_and_kv_cache_dtype_are_rendered(kind, engine, flags):
    from sluice.operator.engine_args import quantization_args

    body = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"replicas": 1, "model": {"name": "m", "source": {"image": {"path": "/m"}}},
                     "engine": {"kind": kind, **engine}}}
    assert quantization_args(PoolSpec.from_body(body)) == flags

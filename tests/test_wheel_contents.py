"""The wheel (what `pip install .` and the engine image install) carries every file the
package reads at run time, not only its Python modules: the CPU kernels' C sources are
compiled on the machine at first use."""

from __future__ import annotations

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
                              "sluice", "pyproject.toml", "README.md"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    source = tmp_path / "src"
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("sluice-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    data = [f for f in tracked if f.startswith("sluice/") and not f.endswith(".py")]
    assert "sluice/engine/attention/cpu_attention.c" in data
    assert [f for f in data if f not in inside] == []

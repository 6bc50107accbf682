"""The model's linear layer (sluice/engine/layers/linear.py): once loaded, a bf16 weight on
the CPU runs oneDNN's packed kernel with the same outputs as torch's for every shape a step
gives it; anything else keeps torch's kernel."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.layers.linear import Linear, can_pack

needs_bf16 = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="no oneDNN bf16 kernels on this CPU")


def loaded(in_features: int, out_features: int, bias: bool, dtype=torch.bfloat16) -> Linear:
    layer = Linear(in_features, out_features, bias).to(dtype)
    with torch.no_grad():
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    return layer.requires_grad_(False)


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_equals_torch(rows, bias):
    torch.manual_seed(rows)
    layer = loaded(96, 200, bias)
    weight, b = layer.weight.clone(), None if layer.bias is None else layer.bias.clone()
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = F.linear(x, weight, b)
        assert torch.equal(layer(x), expected)
        layer.process_weights_after_loading()
        assert layer.packed is not None and "weight" not in dict(layer.named_parameters())
        assert torch.equal(layer(x), expected)
        # 3-D and non-contiguous inputs, as views of a step's activations are
        assert torch.equal(layer(x.view(1, rows, 96)), expected.view(1, rows, 200))
        wide = torch.randn(rows, 192, dtype=torch.bfloat16)
        assert torch.equal(layer(wide[:, ::2]), F.linear(wide[:, ::2], weight, b))
    with pytest.raises(AssertionError, match="twice"):
        layer.process_weights_after_loading()


@needs_bf16
def test_a_tied_weight_stays_with_the_module_it_is_tied_to():
    embed = nn.Embedding(50, 16).to(torch.bfloat16)
    head = Linear(16, 50)
    head.weight = embed.weight
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = head(x)
        head.process_weights_after_loading()
        assert torch.equal(head(x), expected)
    assert embed.weight.dtype == torch.bfloat16 and embed.weight.shape == (50, 16)


def test_float32_and_other_devices_keep_torch_kernels():
    assert not can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.bfloat16, torch.device("meta"))
    layer = loaded(8, 4, True, torch.float32)
    layer.process_weights_after_loading()
    assert layer.packed is None and layer.weight.shape == (4, 8)


@needs_bf16
def test_a_loaded_model_runs_outside_inference_mode_without_autograd(tiny_models):
    """Callers that run the model outside torch.inference_mode (the early-exit proposer)
    must not build autograd graphs: an input requiring grad sent the packed linears'
    oneDNN op through autograd's fallback, ~700x slower."""
    from sluice.engine.attention.torch_backend import TorchAttentionBackend
    from sluice.engine.loader import load_model

    lm = load_model(str(tiny_models["llama"]), "auto", TorchAttentionBackend(),
                    torch.bfloat16, torch.device("cpu"))
    linears = [m for m in lm.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    assert not any(p.requires_grad for p in lm.parameters())
    hidden = lm.model.embed_tokens(torch.tensor([1, 2, 3]))
    assert not hidden.requires_grad and not lm.compute_logits(hidden).requires_grad

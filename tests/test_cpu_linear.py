"""CPU linears in oneDNN's layout (sluice/engine/model/cpu_linear.py): the same outputs as
nn.Linear for every shape a step gives them, and packed only where they should be."""

import pytest
import torch
from torch import nn

from sluice.engine.model.cpu_linear import PackedLinear, can_pack, pack_linears

needs_bf16 = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="no oneDNN bf16 kernels on this CPU")


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_equals_nn_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x)
        packed = PackedLinear(linear)
        assert torch.equal(packed(x), expected)
        # 3-D and non-contiguous inputs, as views of a step's activations are
        assert torch.equal(packed(x.view(1, rows, 96)), expected.view(1, rows, 200))
        wide = torch.randn(rows, 192, dtype=torch.bfloat16)
        assert torch.equal(packed(wide[:, ::2]), linear(wide[:, ::2]))


@needs_bf16
def test_every_linear_is_replaced_and_a_tied_weight_stays():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.body = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight

    model = Tiny().to(torch.bfloat16)
    x = torch.randint(0, 50, (5,))
    with torch.inference_mode():
        expected = model.head(model.body(model.embed(x)))
        assert pack_linears(model) == 3
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        assert torch.equal(model.head(model.body(model.embed(x))), expected)
    assert model.embed.weight.dtype == torch.bfloat16  # the embedding keeps its table


def test_float32_and_other_devices_keep_torch_kernels():
    assert not can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.bfloat16, torch.device("meta"))


@needs_bf16
def test_a_loaded_model_runs_outside_inference_mode_without_autograd(tiny_models):
    """Callers that run the model outside torch.inference_mode (the early-exit proposer)
    must not build autograd graphs: an input requiring grad sent the packed linears'
    oneDNN op through autograd's fallback, ~700x slower."""
    from sluice.engine.attention.torch_backend import TorchAttentionBackend
    from sluice.engine.loader import load_model

    lm = load_model(str(tiny_models["llama"]), "auto", TorchAttentionBackend(),
                    torch.bfloat16, torch.device("cpu"))
    assert any(isinstance(m, PackedLinear) for m in lm.modules())
    assert not any(p.requires_grad for p in lm.parameters())
    hidden = lm.model.embed_tokens(torch.tensor([1, 2, 3]))
    assert not hidden.requires_grad and not lm.compute_logits(hidden).requires_grad

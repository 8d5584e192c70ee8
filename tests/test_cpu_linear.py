"""kvlab.cpu_linear: oneDNN-packed linear layers give F.linear's results and follow their weights."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from kvlab.cpu_linear import onednn_available, pack_linear_weights

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build lacks oneDNN")


def _layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 32))


def test_packed_layers_match_f_linear_for_every_batch_size():
    model = _layers()
    reference = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
                 for m in model]
    assert pack_linear_weights(model) == 2
    with torch.no_grad():
        for rows in (1, 7, 16, 64, 300):
            x = torch.randn(rows, 64)
            expected = F.linear(F.linear(x, *reference[0]), *reference[1])
            torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_packing_is_idempotent_and_keeps_the_parameters():
    model = _layers()
    names = sorted(model.state_dict())
    pack_linear_weights(model)
    first = model[0].forward
    assert pack_linear_weights(model) == 2
    assert model[0].forward is first
    assert sorted(model.state_dict()) == names


def test_a_weight_changed_in_place_is_packed_again():
    model = _layers()
    pack_linear_weights(model)
    x = torch.randn(5, 64)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # stale packed copy would give the old product
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight), rtol=1e-5,
                                   atol=1e-5)
        model[0].weight = nn.Parameter(torch.randn(96, 64))  # replaced outright
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight), rtol=1e-5,
                                   atol=1e-5)


def test_autograd_and_other_dtypes_fall_back_to_f_linear():
    model = _layers()
    pack_linear_weights(model)
    x = torch.randn(3, 64, requires_grad=True)
    model(x).sum().backward()  # the oneDNN op has no backward: F.linear must have run
    assert x.grad is not None and model[0].weight.grad is not None
    model = model.to(torch.float64)
    with torch.no_grad():
        y = model(torch.randn(3, 64, dtype=torch.float64))
    assert y.dtype == torch.float64


def test_projections_that_read_one_input_run_as_one_matmul(small_llama):
    """Attention.qkv and MLP.gate_up become one packed matmul each; the outputs equal the
    layers' own, and a layer changed in place is packed again."""
    layer = small_llama.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    x = torch.randn(5, attention.q_proj.in_features)
    with torch.no_grad():
        expected = [F.linear(x, attention.q_proj.weight), F.linear(x, attention.k_proj.weight),
                    F.linear(x, attention.v_proj.weight), F.linear(x, mlp.gate_proj.weight),
                    F.linear(x, mlp.up_proj.weight)]
        pack_linear_weights(small_llama)
        assert "qkv" in attention.__dict__ and "gate_up" in mlp.__dict__
        for got, want in zip([*attention.qkv(x), *mlp.gate_up(x)], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        attention.k_proj.weight.mul_(-1.0)
        torch.testing.assert_close(attention.qkv(x)[1], -expected[1], rtol=1e-5, atol=1e-5)


def test_projections_with_and_without_a_bias_are_not_fused(small_config):
    """One matmul has one bias or none: q with a bias and k, v without stay separate layers."""
    from kvlab.model import LlamaForCausalLM

    model = LlamaForCausalLM(small_config).eval()  # its own: the fixture's model is shared
    attention = model.model.layers[0].self_attn
    q = attention.q_proj
    attention.q_proj = nn.Linear(q.in_features, q.out_features)
    x = torch.randn(3, q.in_features)
    with torch.no_grad():
        expected = [F.linear(x, attention.q_proj.weight, attention.q_proj.bias),
                    F.linear(x, attention.k_proj.weight), F.linear(x, attention.v_proj.weight)]
        pack_linear_weights(model)
        assert "qkv" not in attention.__dict__
        for got, want in zip(attention.qkv(x), expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

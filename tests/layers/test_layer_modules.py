"""The AFT token-mixer modules: against the float64 reference, Eq. 8, TorchScript, and the channel-first form
(``forward_nchw``, ``depthwise_mix_nchw``) that OpenVINO is given."""
import copy
import math

import pytest
import torch

import aft_reference as ref
from aft_reference import GRID_SHAPES, grid_inputs
from aft_vision.layers import AFTConv2d, AFTConv2dOneHot, AFTFull, AFTLocal, AFTSimple


def reference(q, k, v, w, causal=False):
    """AFT-full's float64 output."""
    problem = ref.seq_problem(q, k, v, w, 'full', causal=causal)
    return ref.evaluate(problem, torch.zeros(q.shape, dtype=torch.float64))['out']


def conv_reference(q, k, v, w):
    """AFT-conv's float64 output."""
    problem = ref.conv_problem(q, k, v, w)
    return ref.evaluate(problem, torch.zeros(q.shape, dtype=torch.float64))['out']


def test_fresh_aft_conv_equals_aft_simple_with_the_same_projections():
    dim, num_heads = 12, 3
    conv = AFTConv2d(dim, num_heads, kernel_size=5)
    simple = AFTSimple(dim)
    weight, bias = conv.qkv.weight, conv.qkv.bias
    q_rows, k_rows, v_rows = slice(0, dim), slice(dim, dim + num_heads), slice(dim + num_heads, None)
    with torch.no_grad():  # AFT-simple's key for channel c is the conv key of c's head
        simple.qkv.weight.copy_(torch.cat([weight[q_rows], weight[k_rows].repeat_interleave(4, 0), weight[v_rows]]))
        simple.qkv.bias.copy_(torch.cat([bias[q_rows], bias[k_rows].repeat_interleave(4), bias[v_rows]]))
        simple.proj.load_state_dict(conv.proj.state_dict())
    x = torch.randn(2, 5, 7, dim)
    torch.testing.assert_close(conv(x), simple(x.reshape(2, 35, dim)).reshape(2, 5, 7, dim))


def test_aft_local_with_a_window_covering_the_sequence_equals_aft_full():
    full = AFTFull(16, seq_len=9, pos_dim=4)
    local = AFTLocal(16, seq_len=9, window=9, pos_dim=4)
    local.load_state_dict(full.state_dict())
    x = torch.randn(3, 9, 16)
    torch.testing.assert_close(local(x), full(x))


def test_aft_full_module_uses_the_factorised_bias():
    module = AFTFull(8, seq_len=6, pos_dim=3).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    q, k, v = module.qkv(x).chunk(3, dim=-1)
    expected = reference(q, k, v, module.pos_u @ module.pos_v.T)
    torch.testing.assert_close(module(x), module.proj(expected))  # float64 throughout: torch's default tolerance


def test_aft_conv_module_applies_eq8_reparameterisation():
    module = AFTConv2d(8, 2, 3).double()
    with torch.no_grad():
        module.pos_gamma.copy_(torch.tensor([1.5, -0.5]))
        module.pos_beta.copy_(torch.tensor([0.2, 1.0]))
    raw = module.pos_weight
    expected = torch.stack([  # Eq. 8 with the module's eps inside the square root
        g * (r - r.mean()) / torch.sqrt(r.var(unbiased=False) + module.eps) + b
        for r, g, b in zip(raw, module.pos_gamma, module.pos_beta)
    ])
    torch.testing.assert_close(module.position_bias(), expected)  # float64 throughout: torch's default tolerance
    x = torch.randn(2, 4, 3, 8, dtype=torch.float64)
    q, k, v = module.qkv(x).split([8, 2, 8], dim=-1)
    torch.testing.assert_close(module(x), module.proj(conv_reference(q, k, v, module.position_bias())))


def test_constant_raw_bias_stays_finite():
    module = AFTConv2d(8, 2, 3)
    with torch.no_grad():
        module.pos_weight.fill_(0.7)
        module.pos_gamma.fill_(1.0)
    module(torch.randn(1, 4, 4, 8)).sum().backward()
    assert torch.isfinite(module.position_bias()).all()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters())


@pytest.mark.parametrize('layer_cls', [AFTConv2d, AFTConv2dOneHot])
def test_conv_layer_reads_each_calls_window_from_its_grid(layer_cls):
    """``follow_grid``: a window given for an 8 x 8 grid is resampled for a 12 x 12 call as ``resize_window`` would
    resample the layer (5 -> 7), and for an 8 x 8 call left as built; the layer's parameters stay; None undoes it.
    As timm's ``Block`` calls its ``attn``, with a mask refused in one line."""
    torch.manual_seed(0)
    layer = layer_cls(16, num_heads=4, kernel_size=5).eval()
    with torch.no_grad():
        layer.pos_gamma.normal_()
        layer.pos_beta.normal_()
    resized = copy.deepcopy(layer)
    resized.resize_window(7)
    big, small = torch.randn(2, 12, 12, 16), torch.randn(2, 8, 8, 16)
    with torch.no_grad():
        built, built_small = layer(big), layer(small)
        layer.follow_grid((8, 8))
        torch.testing.assert_close(layer(big), resized(big), rtol=0, atol=1e-6)
        assert not torch.allclose(layer(big), built, atol=1e-3)
        assert torch.equal(layer(small), built_small)
        layer.follow_grid(None)
        assert torch.equal(layer(big), built) and layer.pos_weight.shape == (4, 5, 5)
    for kwargs in (dict(attn_mask=torch.ones(64, 64, dtype=torch.bool)), dict(is_causal=True)):
        with pytest.raises(ValueError, match='no attn_mask and no is_causal') as refused:
            layer(small, **kwargs)
        assert '\n' not in str(refused.value)


@pytest.mark.parametrize('module, x', [
    (AFTFull(16, seq_len=10), torch.randn(2, 10, 16)),
    (AFTLocal(16, seq_len=10, window=3, causal=True), torch.randn(2, 10, 16)),
    (AFTSimple(16), torch.randn(2, 10, 16)),
    (AFTConv2d(16, 4, 3), torch.randn(2, 3, 5, 16)),
])
def test_module_shapes_gradients_and_torchscript(module, x):
    out = module(x)
    assert out.shape == x.shape
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.parameters())
    scripted = torch.jit.script(module)
    torch.testing.assert_close(scripted(x), out)
    assert math.isfinite(out.abs().max().item())


# ---------------------------------------------------------------------------------------------------------------------
# The channel-first form (``forward_nchw``, ``depthwise_mix_nchw``): what OpenVINO is given, held to the float64
# reference on its own, as an exported graph is (the 'cuda' policy's bound: no repair in a graph)

def _nchw(x):
    return x.permute(0, 3, 1, 2)


@pytest.mark.parametrize('shape', GRID_SHAPES)
@pytest.mark.parametrize('scale', [1.0, 3.0])
def test_channel_first_sums_match_reference(shape, scale):
    from aft_vision.layers.depthwise_mix import depthwise_mix_nchw
    q, k, v, w = grid_inputs(*shape, scale, scale)
    out = depthwise_mix_nchw(_nchw(q), _nchw(k), _nchw(v), w).permute(0, 2, 3, 1)
    ref.assert_output(out, ref.conv_problem(q, k, v, w), ref.terms_for('conv', 'cuda'), label=f'{shape} x{scale}')
    extreme = depthwise_mix_nchw(*(_nchw(x) * 1e4 for x in (q, k, v)), w * 1e4)
    assert torch.isfinite(extreme).all()


@pytest.mark.parametrize('layer_cls', [AFTConv2d, AFTConv2dOneHot])
@pytest.mark.parametrize('dim, heads, kernel', [(16, 4, 5), (12, 12, 3)])
def test_layer_forward_nchw_equals_forward(layer_cls, dim, heads, kernel):
    """The layer on a channel-first map computes its token-row forward (eval; the one-hot layer's indexing form)."""
    torch.manual_seed(0)
    layer = layer_cls(dim, num_heads=heads, kernel_size=kernel).eval()
    with torch.no_grad():
        for param in (layer.pos_gamma, layer.pos_beta):
            param.normal_()
        x = torch.randn(2, 6, 5, dim)
        got = layer.forward_nchw(_nchw(x)).permute(0, 2, 3, 1)
        eager, exact = layer(x), copy.deepcopy(layer).double()(x.double())
    ref.assert_model_agrees(got, exact, eager, label=f'{layer_cls.__name__} {dim}/{heads}/{kernel}')
    with pytest.raises(ValueError, match=rf'expected a map \(B, {dim}, H, W\)'):
        layer.forward_nchw(x)

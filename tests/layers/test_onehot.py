"""The one-hot AFT-conv of Sec. 8 (``aft_conv2d_onehot``, ``AFTConv2dOneHot``) against the plain operator."""
import pytest
import torch

from aft_reference import grid_inputs
from aft_vision.layers import AFTConv2d, AFTConv2dOneHot, aft_conv2d, aft_conv2d_onehot
from aft_vision.layers.aft_conv_onehot import onehot_bias


@pytest.mark.parametrize('height,width,kernel,heads', [
    (1, 1, 5, 2),  # every offset but the centre falls off the map
    (2, 3, 5, 2),
    (5, 5, 7, 4),
    (7, 4, 15, 4),  # kernel larger than the map
    (12, 12, 3, 3),
    (9, 11, 5, 1),
])
def test_onehot_indexing_equals_dense_operator(height, width, kernel, heads):
    q, k, v, w = grid_inputs(2, height, width, 3 * heads, heads, kernel, 3.0, 2.0, height * 100 + width, torch.float64)
    gen = torch.Generator().manual_seed(height * 100 + width)
    corners = torch.tensor([0, kernel - 1, kernel * (kernel - 1), kernel * kernel - 1])
    for index in [torch.randint(0, kernel * kernel, (heads,), generator=gen), corners[torch.arange(heads) % 4],
                  torch.full((heads,), kernel * kernel // 2)]:  # random, corners (off the map), centre
        fast = aft_conv2d_onehot(q, k, v, w, index)
        bias = onehot_bias(w, index)
        assert (bias != 0).sum() <= heads
        for method in ('dense', 'conv'):
            torch.testing.assert_close(fast, aft_conv2d(q, k, v, bias, method=method), rtol=1e-10, atol=1e-12)


def test_onehot_gradients_and_extremes_match_dense():
    q, k, v, w = grid_inputs(2, 5, 6, 8, 2, 5, dtype=torch.float64)
    index = torch.tensor([3, 17])
    inputs = [t.clone().requires_grad_() for t in (q, k, v, w)]
    fast_grads = torch.autograd.grad(aft_conv2d_onehot(*inputs, index).square().sum(), inputs)
    dense_grads = torch.autograd.grad(aft_conv2d(*inputs[:3], onehot_bias(inputs[3], index)).square().sum(), inputs)
    for fast, dense in zip(fast_grads, dense_grads):
        torch.testing.assert_close(fast, dense)
    # one dominant key seen through a very negative bias (cancellation), and a huge bias (overflow of exp(w))
    k_extreme = k.clone()
    k_extreme[:, 2, 3] = 200.0
    for dtype in (torch.float64, torch.float32):
        for scale in (-80.0, 300.0):
            args = [t.to(dtype) for t in (q, k_extreme, v, torch.full_like(w, scale))]
            fast = aft_conv2d_onehot(*args, index)
            assert torch.isfinite(fast).all()
            torch.testing.assert_close(fast, aft_conv2d(*args[:3], onehot_bias(args[3], index)))
    half = aft_conv2d_onehot(q.half(), k.half(), v.half(), w.float(), index)
    assert half.dtype == torch.float16


@pytest.mark.filterwarnings('ignore:`torch.jit.script` is deprecated')
def test_onehot_layer_train_and_eval():
    torch.manual_seed(0)
    dense = AFTConv2d(dim=16, num_heads=4, kernel_size=5)
    with torch.no_grad():
        dense.pos_gamma.fill_(1.5)
        dense.pos_beta.fill_(0.2)
    layer = AFTConv2dOneHot.from_dense(dense).eval()
    assert layer.tau == 0.5 and layer.hard
    w = dense.position_bias().detach()
    torch.testing.assert_close(layer.position_bias(), dense.position_bias())  # Eq. 8, as in AFTConv2d
    bias = layer.selected_bias().detach()
    flat = bias.flatten(1)
    argmax = w.flatten(1).argmax(1)
    assert ((flat != 0).sum(1) == 1).all()  # one offset per head at inference
    torch.testing.assert_close(flat[torch.arange(4), argmax], w.flatten(1)[torch.arange(4), argmax])
    offsets = layer.selected_offsets()
    torch.testing.assert_close(offsets, torch.stack([argmax // 5, argmax % 5], 1) - 2)

    x = torch.randn(2, 6, 7, 16)
    q, k, v = dense.qkv(x).split([16, 4, 16], dim=-1)
    expected = dense.proj(aft_conv2d(q, k, v, bias))
    torch.testing.assert_close(layer(x), expected)  # the indexing path equals Eq. 6 with the one-hot bias

    scripted = torch.jit.script(layer)
    torch.testing.assert_close(scripted(x), expected)

    layer.train()
    sample = layer.selected_bias().flatten(1)
    assert ((sample != 0).sum(1) <= 1).all()  # a hard Gumbel sample: at most one offset (w may be 0 there)
    nonzero = sample != 0
    torch.testing.assert_close(sample[nonzero], w.flatten(1)[nonzero])
    layer(x).sum().backward()
    assert layer.pos_weight.grad.abs().sum() > 0 and layer.pos_gamma.grad.abs().sum() > 0
    assert layer.state_dict().keys() == dense.state_dict().keys()


@pytest.mark.parametrize('shapes, index, match', [
    (((1, 4, 4, 6), (1, 4, 4, 4), (1, 4, 4, 6), (4, 3, 3)), 4, 'not divisible by h = 4'),
    (((1, 4, 4, 8), (1, 4, 4, 4), (1, 4, 4, 8), (4, 2, 2)), 4, 'must be odd'),
    (((1, 4, 4, 8), (1, 4, 4, 4), (1, 3, 4, 8), (4, 3, 3)), 4, 'v'),
    (((1, 4, 4, 8), (1, 4, 4, 4), (1, 4, 4, 8), (4, 3, 3)), 3, r'index must be \(4,\)'),
])
def test_onehot_operator_names_bad_inputs(shapes, index, match):
    q, k, v, w = (torch.randn(shape) for shape in shapes)
    with pytest.raises(ValueError, match=match):
        aft_conv2d_onehot(q, k, v, w, torch.zeros(index, dtype=torch.long))

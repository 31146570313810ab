"""The depthwise AFT-conv backward by forward convolutions (``depthwise_conv_backward``): against float64 and
``aten.convolution_backward`` on every odd window from 1 to 31, maps smaller than the window, non-square maps and
both layouts the device policies use; the whole operator by float64 gradcheck under both policies and both methods.

Bounds follow from rounding: every gradient entry is a sum of n products of float32 numbers (n = s^2 for the input's,
B H W for the kernel's), so in any summation order it lies within ``gamma_n * sum |terms|`` of the exact value,
``gamma_n = n u / (1 - n u)``, u = 2^-24, and ``sum |terms|`` is the same convolution of the absolute values.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aft_vision.layers import aft_conv2d, device_policy
from aft_vision.layers.aft_conv_onehot import onehot_bias
from aft_vision.layers.depthwise_mix import depthwise_conv_backward
from aft_vision.layers.dispatch import DEPTHWISE_BACKWARD_METHODS, choose_depthwise_backward, depthwise_backward

WINDOWS = list(range(1, 32, 2))
MAPS = [(1, 1), (2, 3), (5, 4), (6, 6), (3, 9)]  # (H, W): 1 x 1, smaller than most windows, non-square


def gamma(n: int, unit: float = 2.0 ** -24) -> float:
    return n * unit / (1 - n * unit)


def native(grad, x, kernel):
    """``aten.convolution_backward`` of the zero-padded depthwise convolution (both gradients)."""
    pad = kernel.shape[-1] // 2
    grad_x, grad_kernel, _ = torch.ops.aten.convolution_backward(
        grad, x, kernel, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], kernel.shape[0], [True, True, False])
    return grad_x, grad_kernel


def conv_case(batch, height, width, channels, s, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    grad, x = (torch.randn(batch, height, width, channels, generator=gen).permute(0, 3, 1, 2) for _ in range(2))
    if layout == 'contiguous':  # the 'cuda' policy's layout; the 'cpu' policy's is the channels-last view
        grad, x = grad.contiguous(), x.contiguous()
    return grad, x, torch.randn(channels, 1, s, s, generator=gen)


@pytest.mark.parametrize('s', WINDOWS)
@pytest.mark.parametrize('grid', MAPS)
@pytest.mark.parametrize('layout', ['channels_last', 'contiguous'])
def test_forward_conv_gradients_within_rounding_of_float64_and_native(s, grid, layout):
    batch = 2
    grad, x, kernel = conv_case(batch, *grid, 3, s, layout, seed=s)
    exact = native(grad.double(), x.double(), kernel.double())
    magnitude = native(grad.double().abs(), x.double().abs(), kernel.double().abs())  # sum |terms| per entry
    bounds = (gamma(s * s) * magnitude[0], gamma(batch * grid[0] * grid[1]) * magnitude[1])
    ours, theirs = depthwise_conv_backward(grad, x, kernel, 'forward_conv'), native(grad, x, kernel)
    for name, mine, lib, truth, bound in zip(('input', 'kernel'), ours, theirs, exact, bounds):
        assert mine.shape == truth.shape and mine.dtype == torch.float32
        assert ((mine.double() - truth).abs() <= bound).all(), f'{name} gradient off float64'
        assert ((mine.double() - lib.double()).abs() <= 2 * bound).all(), f'{name} gradient off convolution_backward'


def test_forward_conv_gradients_in_float64_match_native():
    grad, x, kernel = (t.double() for t in conv_case(3, 4, 7, 5, 9, 'channels_last'))
    exact = native(grad, x, kernel)
    magnitude = native(grad.abs(), x.abs(), kernel.abs())
    for mine, truth, mag, n in zip(depthwise_conv_backward(grad, x, kernel, 'forward_conv'), exact, magnitude,
                                   (81, 3 * 4 * 7)):
        assert ((mine - truth).abs() <= 2 * gamma(n, 2.0 ** -53) * mag).all()


def test_unknown_backward_is_refused():
    grad, x, kernel = conv_case(1, 2, 2, 1, 3, 'channels_last')
    with pytest.raises(ValueError, match='forward_conv'):
        depthwise_conv_backward(grad, x, kernel, 'fft')
    with pytest.raises(ValueError, match='forward_conv'):
        with depthwise_backward('fft'):
            pass


def test_defaults_per_device_and_the_override():
    assert choose_depthwise_backward('cpu') == 'forward_conv'
    assert choose_depthwise_backward('cuda') == 'convolution_backward'  # the CUDA default stays as it was
    assert choose_depthwise_backward('mps') == 'forward_conv'
    for method in DEPTHWISE_BACKWARD_METHODS:
        with depthwise_backward(method):
            assert choose_depthwise_backward('cpu') == choose_depthwise_backward('cuda') == method
    assert choose_depthwise_backward('cuda') == 'convolution_backward'


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def grid_inputs(batch, height, width, channels, num_heads, s, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, v = (torch.randn(batch, height, width, channels, generator=gen, dtype=dtype) for _ in range(2))
    k = torch.randn(batch, height, width, num_heads, generator=gen, dtype=dtype)
    w = torch.randn(num_heads, s, s, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, w)]


@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
@pytest.mark.parametrize('method', DEPTHWISE_BACKWARD_METHODS)
def test_the_operator_takes_the_chosen_backward(policy, method):
    q, k, v, w = grid_inputs(2, 5, 4, 6, 3, 7, dtype=torch.float32)
    with device_policy(policy), depthwise_backward(method):
        out = aft_conv2d(q, k, v, w, method='conv')
        with OpNames() as seen:
            out.sum().backward()
    assert ('convolution_backward' in seen.names) == (method == 'convolution_backward')


# (B, H, W, C, h, s): 1 x 1 map, window larger than the map, non-square, h = 1, h = C
GRAD_SHAPES = [(1, 1, 1, 2, 1, 3), (2, 3, 5, 4, 2, 9), (1, 4, 2, 3, 3, 5), (2, 4, 4, 4, 1, 1), (1, 3, 3, 2, 2, 31)]


@pytest.mark.parametrize('shape', GRAD_SHAPES)
@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
@pytest.mark.parametrize('method', DEPTHWISE_BACKWARD_METHODS)
def test_operator_gradcheck_float64(shape, policy, method):
    inputs = grid_inputs(*shape, seed=sum(shape))
    with device_policy(policy), depthwise_backward(method):
        assert torch.autograd.gradcheck(lambda *t: aft_conv2d(*t, method='conv'), inputs)


@pytest.mark.parametrize('method', DEPTHWISE_BACKWARD_METHODS)
def test_onehot_bias_gradcheck_float64(method):
    """The one-hot variant's training path is the same operator on a one-hot bias."""
    q, k, v, w = grid_inputs(2, 4, 5, 4, 2, 5, seed=3)
    index = torch.tensor([3, 17])
    with depthwise_backward(method):
        assert torch.autograd.gradcheck(lambda *t: aft_conv2d(*t[:3], onehot_bias(t[3], index), method='conv'),
                                        (q, k, v, w))

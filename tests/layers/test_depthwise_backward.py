"""AFT-conv's depthwise backward by forward convolutions (``depthwise_conv_backward``), on CPU and CUDA alike.

Against float64 and ``aten.convolution_backward`` on every odd window from 1 to 31, maps smaller than the window,
non-square maps and both convolution layouts (the kernel's gradient in one call over contiguous planes, per image
on channels-last maps); the whole operator by float64 gradcheck under both policies. Bounds
follow from rounding: every gradient entry is a sum of n products of float32 numbers (n = s^2 for the input's, B H W
for the kernel's), so in any summation order it lies within ``gamma_n * sum |terms|`` of the exact value,
``gamma_n = n u / (1 - n u)``, u = 2^-24, and ``sum |terms|`` is the same convolution of the absolute values.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aft_reference import grid_inputs
from aft_vision.layers import aft_conv2d, device_policy
from aft_vision.layers.aft_conv_onehot import onehot_bias
from aft_vision.layers.depthwise_mix import depthwise_conv_backward

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
    """An upstream gradient and an input (B, n, H, W) and a kernel (n, 1, s, s), from ``grid_inputs``'s q, v, w."""
    grad, _, x, kernel = grid_inputs(batch, height, width, channels, channels, s, seed=seed)
    grad, x = grad.permute(0, 3, 1, 2), x.permute(0, 3, 1, 2)  # channels-last views: the CPU's layout
    if layout == 'contiguous':  # the layout on CUDA
        grad, x = grad.contiguous(), x.contiguous()
    return grad, x, kernel.unsqueeze(1)


@pytest.mark.parametrize('s', WINDOWS)
@pytest.mark.parametrize('grid', MAPS)
@pytest.mark.parametrize('layout', ['channels_last', 'contiguous'])
def test_forward_conv_gradients_within_rounding_of_float64_and_native(s, grid, layout):
    batch = 2
    grad, x, kernel = conv_case(batch, *grid, 3, s, layout, seed=s)
    exact = native(grad.double(), x.double(), kernel.double())
    magnitude = native(grad.double().abs(), x.double().abs(), kernel.double().abs())  # sum |terms| per entry
    bounds = (gamma(s * s) * magnitude[0], gamma(batch * grid[0] * grid[1]) * magnitude[1])
    ours, theirs = depthwise_conv_backward(grad, x, kernel, kernel.new_zeros(kernel.shape[0])), native(grad, x, kernel)
    for name, mine, lib, truth, bound in zip(('input', 'kernel'), ours, theirs, exact, bounds):
        assert mine.shape == truth.shape and mine.dtype == torch.float32
        assert ((mine.double() - truth).abs() <= bound).all(), f'{name} gradient off float64'
        assert ((mine.double() - lib.double()).abs() <= 2 * bound).all(), f'{name} gradient off convolution_backward'


def test_forward_conv_gradients_in_float64_match_native():
    grad, x, kernel = (t.double() for t in conv_case(3, 4, 7, 5, 9, 'channels_last'))
    exact = native(grad, x, kernel)
    magnitude = native(grad.abs(), x.abs(), kernel.abs())
    ours = depthwise_conv_backward(grad, x, kernel, kernel.new_zeros(kernel.shape[0]))
    for mine, truth, mag, n in zip(ours, exact, magnitude, (81, 3 * 4 * 7)):
        assert ((mine - truth).abs() <= 2 * gamma(n, 2.0 ** -53) * mag).all()


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def leaf_grid_inputs(*shape, dtype=torch.float64, seed=0):
    return [t.requires_grad_() for t in grid_inputs(*shape, seed=seed, dtype=dtype)]


@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
def test_the_operator_takes_forward_convolutions(policy):
    """The backward never calls the library's depthwise backward, whatever the policy (the 'cuda' policy on CPU
    tensors runs the CPU layout; on CUDA tensors the contiguous layout takes the same path)."""
    q, k, v, w = leaf_grid_inputs(2, 5, 4, 6, 3, 7, dtype=torch.float32)
    with device_policy(policy):
        out = aft_conv2d(q, k, v, w, method='conv')
        with OpNames() as seen:
            out.sum().backward()
    assert 'convolution' in seen.names and 'convolution_backward' not in seen.names


# (B, H, W, C, h, s): 1 x 1 map, window larger than the map, non-square, h = 1, h = C
GRAD_SHAPES = [(1, 1, 1, 2, 1, 3), (2, 3, 5, 4, 2, 9), (1, 4, 2, 3, 3, 5), (2, 4, 4, 4, 1, 1), (1, 3, 3, 2, 2, 31)]


@pytest.mark.parametrize('shape', GRAD_SHAPES)
@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
def test_operator_gradcheck_float64(shape, policy):
    inputs = leaf_grid_inputs(*shape, seed=sum(shape))
    with device_policy(policy):
        assert torch.autograd.gradcheck(lambda *t: aft_conv2d(*t, method='conv'), inputs)


def test_onehot_bias_gradcheck_float64():
    """The one-hot variant's training path is the same operator on a one-hot bias."""
    q, k, v, w = leaf_grid_inputs(2, 4, 5, 4, 2, 5, seed=3)
    index = torch.tensor([3, 17])
    assert torch.autograd.gradcheck(lambda *t: aft_conv2d(*t[:3], onehot_bias(t[3], index), method='conv'),
                                    (q, k, v, w))


@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
def test_create_graph_is_refused_in_one_line(policy):
    """``DepthwiseMix`` saves sigmoid(q), p v, p and D, not its inputs: its backward has no graph of its own, so a
    second derivative is refused, naming the way to one."""
    q, k, v, w = leaf_grid_inputs(1, 3, 3, 2, 1, 3, dtype=torch.float32)
    with device_policy(policy):
        out = aft_conv2d(q, k, v, w, method='conv')
    with pytest.raises(RuntimeError, match="DepthwiseMix's backward has no second derivative: .*plain_autograd"):
        torch.autograd.grad(out.sum(), (q, k, v, w), create_graph=True)

"""The AFT operators and modules (``aft_vision.layers``) against the float64 reference written from the paper.

* The functional operators and the modules against ``aft_reference.py`` (Eqs. 2, 4, 5, 6), and gradcheck.
* AFT-conv's depthwise backward by forward convolutions, and gradcheck of the operator.
* The CUDA behaviour of the operators (no host copies, autocast, graph capture, fullgraph compile) on the CPU.
* Property-based tests of the functional operators against the reference, on hostile inputs.
* The fused windowed Triton kernel, run by Triton's interpreter in a subprocess of this file, against the reference.
* The one-hot AFT-conv of Sec. 8 against the plain operator.
"""
import contextlib
import copy
import json
import math
import os
import subprocess
import sys
from unittest import mock

import pytest
import timm
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import aft_reference as ref
import aft_vision  # noqa: F401  registers the models
from aft_reference import CAUSAL, inputs
from aft_vision.layers import (AFTConv2d, AFTFull, AFTLocal, AFTSimple, aft_conv2d, aft_full, aft_local, aft_simple,
                               choose_conv_method, device_policy, functional)
from aft_vision.layers.aft_conv_onehot import AFTConv2dOneHot, aft_conv2d_onehot, onehot_bias
from aft_vision.layers.depthwise_mix import depthwise_conv_backward
from aft_vision.layers.dispatch import DEPTHWISE_BACKWARD_METHODS, choose_depthwise_backward, depthwise_backward
from aft_vision.layers.policy import get_device_policy
from triton_check import CASES, HALF_CASES, make_inputs, ratios, reference_and_bound

# ---------------------------------------------------------------------------------------------------------------------
# AFT operators and modules against a plain float64 reference written from the paper's equations.
# ---------------------------------------------------------------------------------------------------------------------


# The reference is aft_reference.py's: Eqs. 2, 4, 5 and 6 as a dense float64 softmax, and a per-entry bound from
# float32 rounding and the case's conditioning. Under the 'cpu' policy (the default here) every operator is exact to
# rounding for any finite input: underflowed or cancelled entries are recomputed.

def reference(q, k, v, w, causal=False):
    """AFT-full's float64 output."""
    problem = ref.seq_problem(q, k, v, w, 'full', causal=causal)
    return ref.evaluate(problem, torch.zeros(q.shape, dtype=torch.float64))['out']


def conv_reference(q, k, v, w):
    """AFT-conv's float64 output."""
    problem = ref.conv_problem(q, k, v, w)
    return ref.evaluate(problem, torch.zeros(q.shape, dtype=torch.float64))['out']


SEQ_SHAPES = [(1, 1, 1), (2, 7, 3), (3, 12, 5)]  # (B, T, C)
# (B, H, W, C, h, s): square and not, h = 1 and h = C, kernel larger than the map, a 1 x 1 map.
GRID_SHAPES = [(1, 1, 1, 1, 1, 1), (2, 3, 4, 6, 3, 5), (1, 5, 2, 4, 4, 3), (2, 4, 4, 8, 1, 11), (1, 6, 7, 6, 2, 3)]


def seq_inputs(batch, seq_len, channels, scale=1.0, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, batch, seq_len, channels, generator=gen, dtype=dtype)
    w = torch.randn(seq_len, seq_len, generator=gen, dtype=dtype)
    return q, k * scale, v, w * scale


def grid_inputs(batch, height, width, channels, num_heads, s, scale=1.0, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, v = torch.randn(2, batch, height, width, channels, generator=gen, dtype=dtype)
    k = torch.randn(batch, height, width, num_heads, generator=gen, dtype=dtype)
    w = torch.randn(num_heads, s, s, generator=gen, dtype=dtype)
    return q, k * scale, v, w * scale


# ---------------------------------------------------------------------------------------------------------------------
# Functional operators against the reference.

@pytest.mark.parametrize('shape', SEQ_SHAPES)
@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('scale', [1.0, 30.0, 1e4])
def test_aft_full_matches_reference(shape, causal, scale):
    q, k, v, w = seq_inputs(*shape, scale=scale)
    ref.assert_output(aft_full(q, k, v, w, causal=causal), ref.seq_problem(q, k, v, w, 'full', causal=causal))


@pytest.mark.parametrize('shape', SEQ_SHAPES)
@pytest.mark.parametrize('window', [1, 2, 5, 100])
@pytest.mark.parametrize('causal', [False, True])
def test_aft_local_matches_reference(shape, window, causal):
    q, k, v, w = seq_inputs(*shape, scale=3.0)
    ref.assert_output(aft_local(q, k, v, w, window, causal=causal),
                      ref.seq_problem(q, k, v, w, 'local', window=window, causal=causal))


@pytest.mark.parametrize('shape', SEQ_SHAPES)
@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('scale', [1.0, 1e4])
def test_aft_simple_matches_reference(shape, causal, scale):
    q, k, v, _ = seq_inputs(*shape, scale=scale)
    ref.assert_output(aft_simple(q, k, v, causal=causal), ref.seq_problem(q, k, v, None, 'simple', causal=causal))


@pytest.mark.parametrize('shape', GRID_SHAPES)
@pytest.mark.parametrize('method', ['conv', 'dense', 'auto'])
@pytest.mark.parametrize('scale', [1.0, 30.0, 1e4])
def test_aft_conv2d_matches_reference(shape, method, scale):
    q, k, v, w = grid_inputs(*shape, scale=scale)
    ref.assert_output(aft_conv2d(q, k, v, w, method=method), ref.conv_problem(q, k, v, w),
                      ref.terms_for(method, 'cpu'))


@pytest.mark.parametrize('method', ['conv', 'dense'])
@pytest.mark.parametrize('offset', [-30.0, -1e4, 1e4])
def test_aft_conv2d_bias_far_from_zero(method, offset):
    """Strongly negative biases make ``exp(w) - 1`` cancel against the global sum; large ones dominate it."""
    q, k, v, w = grid_inputs(2, 5, 5, 4, 2, 3)
    w = w + offset
    ref.assert_output(aft_conv2d(q, k, v, w, method=method), ref.conv_problem(q, k, v, w),
                      ref.terms_for(method, 'cpu'))


def test_causal_prefix_with_keys_far_below_later_ones():
    q, k, v, w = seq_inputs(2, 9, 4)
    k[:, :5] -= 1e4  # the prefix underflows when shifted by the later keys' maximum
    ref.assert_output(aft_simple(q, k, v, causal=True), ref.seq_problem(q, k, v, None, 'simple', causal=True))
    ref.assert_output(aft_full(q, k, v, w, causal=True), ref.seq_problem(q, k, v, w, 'full', causal=True))


@pytest.mark.parametrize('op', ['full', 'local', 'simple', 'conv', 'dense'])
def test_gradients_finite_for_extreme_inputs(op):
    if op in ('conv', 'dense'):
        q, k, v, w = grid_inputs(2, 4, 5, 6, 3, 3, scale=1e4)
    else:
        q, k, v, w = seq_inputs(2, 8, 4, scale=1e4)
    for x in (q, k, v, w):
        x.requires_grad_(True)
    out = {
        'full': lambda: aft_full(q, k, v, w, causal=True),
        'local': lambda: aft_local(q, k, v, w, 3),
        'simple': lambda: aft_simple(q, k, v, causal=True),
        'conv': lambda: aft_conv2d(q, k, v, w, method='conv'),
        'dense': lambda: aft_conv2d(q, k, v, w, method='dense'),
    }[op]()
    out.square().sum().backward()
    used = (q, k, v) if op == 'simple' else (q, k, v, w)
    for x in used:
        assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize('op', ['full', 'simple', 'conv'])
def test_autocast_bfloat16_keeps_float32_sums(op):
    if op == 'conv':
        q, k, v, w = grid_inputs(2, 4, 6, 8, 2, 5, scale=50.0)
        problem = ref.conv_problem(q.bfloat16(), k.bfloat16(), v.bfloat16(), w)
        call = lambda a, b, c: aft_conv2d(a, b, c, w)  # noqa: E731
    else:
        q, k, v, w = seq_inputs(2, 10, 8, scale=50.0)
        problem = ref.seq_problem(q.bfloat16(), k.bfloat16(), v.bfloat16(), w, op)
        call = (lambda a, b, c: aft_full(a, b, c, w)) if op == 'full' else aft_simple
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = call(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    # float32 sums on the bfloat16 inputs (AFT-full's product with bfloat16 operands), the result rounded to bfloat16
    ref.assert_output(out, problem, ref.terms_for('auto' if op == 'conv' else op, 'cpu'), torch.float32,
                      torch.bfloat16)


def gradcheck_inputs(tensors):
    return tuple(x.double().requires_grad_(True) for x in tensors)


@pytest.mark.parametrize('scale', [1.0, 100.0])  # 100: the exact fallback carries the gradient
def test_gradcheck(scale):
    q, k, v, w = gradcheck_inputs(seq_inputs(2, 5, 3, scale=scale))
    assert torch.autograd.gradcheck(lambda *a: aft_full(*a, causal=True), (q, k, v, w))
    assert torch.autograd.gradcheck(lambda *a: aft_local(*a, window=2), (q, k, v, w))
    assert torch.autograd.gradcheck(lambda a, b, c: aft_simple(a, b, c, causal=True), (q, k, v))
    assert torch.autograd.gradcheck(aft_simple, (q, k, v))
    q, k, v, w = gradcheck_inputs(grid_inputs(1, 3, 4, 4, 2, 3, scale=scale))
    for method in ('conv', 'dense'):
        assert torch.autograd.gradcheck(lambda *a: aft_conv2d(*a, method=method), (q, k, v, w))


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.numel = max(self.numel, x.numel())
        return out


@pytest.mark.parametrize('op', ['full', 'local', 'conv', 'dense'])
def test_memory_never_holds_a_t_by_t_by_c_tensor(op):
    batch, height, width, channels, num_heads = 2, 8, 8, 32, 4
    seq_len = height * width
    if op in ('conv', 'dense'):
        q, k, v, w = grid_inputs(batch, height, width, channels, num_heads, 5)
        call = lambda: aft_conv2d(q, k, v, w, method=op)  # noqa: E731
        bias_numel = num_heads * seq_len * seq_len if op == 'dense' else 0
    else:
        q, k, v, w = seq_inputs(batch, seq_len, channels)
        call = (lambda: aft_full(q, k, v, w)) if op == 'full' else (lambda: aft_local(q, k, v, w, 7))  # noqa: E731
        bias_numel = seq_len * seq_len
    with LargestTensor() as tracker:
        call()
    assert tracker.numel <= max(bias_numel, batch * seq_len * 2 * (channels + num_heads))
    assert tracker.numel < batch * seq_len * seq_len * channels / 4


def test_conv_paths_agree_on_larger_maps():
    q, k, v, w = grid_inputs(2, 14, 11, 16, 4, 7, scale=2.0)
    problem = ref.conv_problem(q, k, v, w)
    for method in ('conv', 'dense'):
        ref.assert_output(aft_conv2d(q, k, v, w, method=method), problem, ref.terms_for(method, 'cpu'), label=method)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input.

@pytest.mark.parametrize('call, match', [
    (lambda: aft_full(*seq_inputs(2, 4, 3)[:3], torch.zeros(5, 5)), r'w must have shape \(T, T\)'),
    (lambda: aft_full(torch.zeros(2, 4, 3), torch.zeros(2, 4, 2), torch.zeros(2, 4, 3), torch.zeros(4, 4)), 'k'),
    (lambda: aft_full(torch.zeros(2, 4, 3), torch.zeros(2, 4, 3), torch.zeros(2, 5, 3), torch.zeros(4, 4)), 'q and v'),
    (lambda: aft_simple(torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4, 3)), r'3-D \(B, T, C\)'),
    (lambda: aft_simple(torch.zeros(2, 4, 3, dtype=torch.long), torch.zeros(2, 4, 3), torch.zeros(2, 4, 3)),
     'floating-point'),
    (lambda: aft_local(*seq_inputs(1, 4, 2), window=0), 'window'),
    (lambda: aft_conv2d(*grid_inputs(1, 3, 3, 4, 2, 4)), 'odd'),
    (lambda: aft_conv2d(torch.zeros(1, 3, 3, 5), torch.zeros(1, 3, 3, 2), torch.zeros(1, 3, 3, 5),
                        torch.zeros(2, 3, 3)), 'not divisible'),
    (lambda: aft_conv2d(*grid_inputs(1, 3, 3, 4, 2, 3)[:3], torch.zeros(3, 3, 3)), r'w must have shape \(h, s, s\)'),
    (lambda: aft_conv2d(*grid_inputs(1, 3, 3, 4, 2, 3)[:3], torch.zeros(2, 3, 5)), r'w must have shape \(h, s, s\)'),
    (lambda: aft_conv2d(*grid_inputs(1, 3, 3, 4, 2, 3), method='fft'), 'method'),
    (lambda: AFTConv2d(10, 3, 3), 'divisible'),
    (lambda: AFTConv2d(12, 3, 4), 'odd'),
    (lambda: AFTFull(8, 5)(torch.zeros(2, 6, 8)), r'\(B, 5, 8\)'),
    (lambda: AFTConv2d(8, 2, 3)(torch.zeros(2, 4, 4, 6)), r'\(B, H, W, 8\)'),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_non_tensor_raises_type_error():
    with pytest.raises(TypeError, match='q must be a torch.Tensor'):
        aft_simple([[1.0]], torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))


# ---------------------------------------------------------------------------------------------------------------------
# Modules.

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
    torch.testing.assert_close(module.effective_bias(), expected)  # float64 throughout: torch's default tolerance
    x = torch.randn(2, 4, 3, 8, dtype=torch.float64)
    q, k, v = module.qkv(x).split([8, 2, 8], dim=-1)
    torch.testing.assert_close(module(x), module.proj(conv_reference(q, k, v, module.effective_bias())))


def test_constant_raw_bias_stays_finite():
    module = AFTConv2d(8, 2, 3)
    with torch.no_grad():
        module.pos_weight.fill_(0.7)
        module.pos_gamma.fill_(1.0)
    module(torch.randn(1, 4, 4, 8)).sum().backward()
    assert torch.isfinite(module.effective_bias()).all()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters())


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
# The depthwise AFT-conv backward by forward convolutions (``depthwise_conv_backward``): against float64 and
# ``aten.convolution_backward`` on every odd window from 1 to 31, maps smaller than the window, non-square maps and
# both layouts the device policies use; the whole operator by float64 gradcheck under both policies and both methods.
#
# Bounds follow from rounding: every gradient entry is a sum of n products of float32 numbers (n = s^2 for the input's,
# B H W for the kernel's), so in any summation order it lies within ``gamma_n * sum |terms|`` of the exact value,
# ``gamma_n = n u / (1 - n u)``, u = 2^-24, and ``sum |terms|`` is the same convolution of the absolute values.
# ---------------------------------------------------------------------------------------------------------------------


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


def leaf_grid_inputs(batch, height, width, channels, num_heads, s, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, v = (torch.randn(batch, height, width, channels, generator=gen, dtype=dtype) for _ in range(2))
    k = torch.randn(batch, height, width, num_heads, generator=gen, dtype=dtype)
    w = torch.randn(num_heads, s, s, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, w)]


@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
@pytest.mark.parametrize('method', DEPTHWISE_BACKWARD_METHODS)
def test_the_operator_takes_the_chosen_backward(policy, method):
    q, k, v, w = leaf_grid_inputs(2, 5, 4, 6, 3, 7, dtype=torch.float32)
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
    inputs = leaf_grid_inputs(*shape, seed=sum(shape))
    with device_policy(policy), depthwise_backward(method):
        assert torch.autograd.gradcheck(lambda *t: aft_conv2d(*t, method='conv'), inputs)


@pytest.mark.parametrize('method', DEPTHWISE_BACKWARD_METHODS)
def test_onehot_bias_gradcheck_float64(method):
    """The one-hot variant's training path is the same operator on a one-hot bias."""
    q, k, v, w = leaf_grid_inputs(2, 4, 5, 4, 2, 5, seed=3)
    index = torch.tensor([3, 17])
    with depthwise_backward(method):
        assert torch.autograd.gradcheck(lambda *t: aft_conv2d(*t[:3], onehot_bias(t[3], index), method='conv'),
                                        (q, k, v, w))


# ---------------------------------------------------------------------------------------------------------------------
# The CUDA behaviour of the AFT operators, proved on the CPU with ``device_policy('cuda')``, and the 'cpu' policy's
# arithmetic beside it.
#
# Under the 'cuda' policy the operators copy nothing to the host, run their matrix products in the autocast dtype and
# save only their inputs for the backward pass; the 'cpu' policy runs them in bfloat16 under bfloat16 and repairs what
# underflowed or cancelled, for any finite input. Accuracy is held to aft_reference.py's plain float64 softmax over the
# joint logits ``k + w`` (Eqs. 2, 4, 5 and 6, independent of the package), gradients included; host syncs are counted
# at the dispatcher over whole models; graph capture is checked with ``torch.compile(fullgraph=True)``.
# ---------------------------------------------------------------------------------------------------------------------


ALL_MODELS = timm.list_models('aft_*')


def call(op, q, k, v, w, window=3):
    return {
        'full': lambda: aft_full(q, k, v, w),
        'causal': lambda: aft_full(q, k, v, w, causal=True),
        'local': lambda: aft_local(q, k, v, w, window),
        'simple': lambda: aft_simple(q, k, v),
        'simple_causal': lambda: aft_simple(q, k, v, causal=True),
        'dense': lambda: aft_conv2d(q, k, v, w, method='dense'),
        'conv': lambda: aft_conv2d(q, k, v, w, method='conv'),
    }[op]()


OPS = list(ref.OPS)


def run_with_grads(op, q, k, v, w, grad_out, autocast_dtype=None):
    """Output and gradients (q, k, v, w) of ``op`` against ``grad_out``; under ``autocast_dtype`` the float32 leaves
    are cast to it first, as a model's activations would be."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, w)]
    if autocast_dtype is None:
        out = call(op, *leaves)
    else:
        with torch.autocast('cpu', dtype=autocast_dtype):
            out = call(op, *(x.to(autocast_dtype) for x in leaves[:3]), leaves[3])
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    return dict(zip(['out', 'dq', 'dk', 'dv', 'dw'], (out,) + grads))


def upstream(q, seed=1):
    return torch.randn(q.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------------------
# Accuracy, within the per-entry rounding bound of aft_reference.py (float32 sums; bfloat16 operands under autocast):
# the 'cuda' policy with keys up to scale 20 and biases up to scale 3 (what Eq. 8 gives a trained model); the 'cpu'
# policy also far beyond, where the shifted sums underflow or cancel and the host recomputes the entries, its dense
# products in bfloat16 under bfloat16 all the same.

POLICY_CASES = [('cuda', 1.0, 1.0), ('cuda', 20.0, 3.0), ('cpu', 1.0, 1.0), ('cpu', 20.0, 3.0), ('cpu', 60.0, 40.0)]


@pytest.mark.parametrize('op', OPS)
@pytest.mark.parametrize('policy,key_scale,bias_scale', POLICY_CASES)
@pytest.mark.parametrize('precision', ['fp32', 'bf16'])
def test_policy_output_and_gradients_match_reference(op, policy, key_scale, bias_scale, precision):
    if policy == 'cuda' and op in CAUSAL:  # a prefix's keys must lie within ~50 of the sequence's largest (limits)
        key_scale = min(key_scale, 5.0)
    q, k, v, w = inputs(op, key_scale, bias_scale)
    operand = torch.float32 if precision == 'fp32' else torch.bfloat16
    grad_out = upstream(q).to(operand)
    recompute = mock.patch('aft_vision.layers.functional.recompute_flagged', wraps=functional.recompute_flagged)
    with device_policy(policy), recompute as recomputed:
        assert get_device_policy(q.device) == policy
        results = run_with_grads(op, q, k, v, w, grad_out, None if precision == 'fp32' else operand)
    if bias_scale > 3.0 and op != 'simple':  # the case the repair exists for (non-causal AFT-simple cannot underflow)
        assert recomputed.called, f'{op}: nothing was recomputed at key scale {key_scale}, bias scale {bias_scale}'
    # the reference takes the operator's inputs as it saw them: q, k, v rounded to the autocast dtype
    problem = ref.problem_for(op, q.to(operand), k.to(operand), v.to(operand), w)
    bounds = ref.bound(problem, grad_out, ref.terms_for(op, policy), torch.float32, operand)
    ref.assert_within(results, ref.evaluate(problem, grad_out), bounds, f'{op} {policy} {precision}')


@pytest.mark.parametrize('op', ['full', 'causal', 'local', 'dense'])
def test_float16_products_would_break_the_cpu_policy(op):
    """Why the 'cpu' policy takes 16-bit products in bfloat16 only: float16's range (normal above 2^-14) turns weights
    the host check trusts into zeros and subnormals, and the result leaves its bound (or is not finite)."""
    q, k, v, w = inputs(op, 60.0, 40.0)
    grad_out = upstream(q).to(torch.bfloat16)
    with device_policy('cpu'), mock.patch('aft_vision.layers.functional.product_dtype', lambda *_: torch.float16):
        results = run_with_grads(op, q, k, v, w, grad_out, torch.bfloat16)
    problem = ref.problem_for(op, q.bfloat16(), k.bfloat16(), v.bfloat16(), w)
    bounds = ref.bound(problem, grad_out, ref.terms_for(op, 'cpu'), torch.float32, torch.bfloat16)
    with pytest.raises(AssertionError, match='its rounding bound'):
        ref.assert_within(results, ref.evaluate(problem, grad_out), bounds, f'{op} float16 products (must fail)')


@pytest.mark.parametrize('mutation', list(ref.MUTATIONS))
@pytest.mark.parametrize('op', OPS)
@pytest.mark.parametrize('key_scale,bias_scale', [(1.0, 1.0), (20.0, 3.0)])
def test_the_bound_rejects_a_wrong_operator(op, mutation, key_scale, bias_scale):
    """An operator with this defect, returning its exact result rounded to float32, fails the check above."""
    if op in ('simple', 'simple_causal') and mutation == 'window_offset_shifted':
        pytest.skip('equivalent mutant: AFT-simple has no bias to shift')
    if op in CAUSAL:
        key_scale = min(key_scale, 5.0)
    q, k, v, w = inputs(op, key_scale, bias_scale)
    problem, grad_out = ref.problem_for(op, q, k, v, w), upstream(q).float()
    wrong = {name: t.float() for name, t in ref.evaluate(problem, grad_out, mutation).items()}
    bounds = ref.bound(problem, grad_out, ref.terms_for(op, 'cuda'))
    with pytest.raises(AssertionError, match='its rounding bound'):
        ref.assert_within(wrong, ref.evaluate(problem, grad_out), bounds, f'{op} {mutation} (must fail)')


@pytest.mark.parametrize('op', OPS)
@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
def test_float64_gradients_match_the_reference_exactly(op, policy):
    key_scale = 5.0 if policy == 'cuda' and op in CAUSAL else 20.0  # 'cpu' repairs any prefix; 'cuda' has a bound
    q, k, v, w = (x.double() for x in inputs(op, key_scale, 3.0))
    grad_out = upstream(q)
    with device_policy(policy):
        results = run_with_grads(op, q, k, v, w, grad_out)
    problem = ref.problem_for(op, q, k, v, w)
    bounds = ref.bound(problem, grad_out, ref.terms_for(op, policy), torch.float64)
    ref.assert_within(results, ref.evaluate(problem, grad_out), bounds, f'{op} float64')


@pytest.mark.parametrize('op', OPS)
@pytest.mark.parametrize('precision', ['fp32', 'bf16'])
def test_cuda_policy_is_finite_for_extreme_inputs(op, precision):
    q, k, v, w = inputs(op, 1e4, 1e4)
    with device_policy('cuda'):
        results = run_with_grads(op, q, k, v, w, upstream(q), None if precision == 'fp32' else torch.bfloat16)
    for name, result in results.items():
        assert result is None or torch.isfinite(result).all(), name


@pytest.mark.parametrize('policy,half,expected', [
    ('cuda', torch.bfloat16, torch.bfloat16), ('cuda', torch.float16, torch.float16),
    ('cpu', torch.bfloat16, torch.bfloat16), ('cpu', torch.float16, torch.float32),  # float16 would hide underflow
])
@pytest.mark.parametrize('autocast', [True, False], ids=['autocast', 'model_cast'])
@pytest.mark.parametrize('op', ['full', 'dense'])
def test_products_run_in_the_policy_product_dtype(op, policy, half, expected, autocast):
    q, k, v, w = inputs(op, 1.0, 1.0)
    seen = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
                seen.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    context = torch.autocast('cpu', dtype=half) if autocast else contextlib.nullcontext()
    with device_policy(policy), context, Products():
        out = call(op, q.to(half), k.to(half), v.to(half), w)
    assert out.dtype == half
    assert seen and set(seen) == {expected}, (policy, seen)


def test_device_policy_restores_and_rejects_unknown_names():
    device = torch.device('cpu')
    assert get_device_policy(device) == 'cpu'
    with device_policy('cuda'):
        with device_policy('cpu'):
            assert get_device_policy(device) == 'cpu'
        assert get_device_policy(device) == 'cuda'
    assert get_device_policy(device) == 'cpu'
    with pytest.raises(ValueError, match="device_policy must be one of cpu, cuda"):
        with device_policy('tpu'):
            pass


# ---------------------------------------------------------------------------------------------------------------------
# Training memory: the operators save their inputs for the backward pass, nothing else.

@pytest.mark.parametrize('op', OPS)
@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
def test_operators_save_only_their_inputs(op, policy):
    q, k, v, w = (x.requires_grad_(True) for x in inputs(op, 1.0, 1.0))
    storages = set()

    def pack(tensor):
        storages.add((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        return tensor

    with device_policy(policy), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call(op, q, k, v, w)
    allowed = q[..., :1].numel() * 8  # at most a per-row statistic beside the inputs
    if op == 'local':  # aft_local zeroes the bias outside the window first: the windowed (T, T) bias and its mask
        allowed += w.numel() * (w.element_size() + 1)
    inputs_bytes = sum(x.untyped_storage().nbytes() for x in (q, k, v, w))
    saved_bytes = sum(nbytes for _, nbytes in storages)
    own = {x.untyped_storage().data_ptr() for x in (q, k, v, w)}
    extra = sum(nbytes for ptr, nbytes in storages if ptr not in own)
    assert saved_bytes <= inputs_bytes + allowed
    assert extra <= allowed


# ---------------------------------------------------------------------------------------------------------------------
# No host synchronisation over whole models, and graph capture.

SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
            torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default}


class HostSyncs(TorchDispatchMode):
    """Counts the operators that copy a value to the host."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


def small_model(name):
    """A registered model with its architecture kept but only two blocks, at a 64 px input (CPU time)."""
    torch.manual_seed(0)
    return timm.create_model(name, depth=2, img_size=64, num_classes=10), torch.randn(2, 3, 64, 64)


def test_the_sync_counter_sees_a_host_sync():
    x = torch.randn(4)
    with HostSyncs() as counter:
        bool(x.any())
        x.nonzero()
    assert len(counter.calls) == 2


@pytest.mark.parametrize('name', ALL_MODELS)
def test_no_host_sync_in_forward_and_backward(name):
    model, images = small_model(name)
    for mode in ('train', 'eval'):
        getattr(model, mode)()
        model.zero_grad()
        with device_policy('cuda'), HostSyncs() as counter:
            model(images).square().mean().backward()
        assert counter.calls == [], f'{name} ({mode}): {counter.calls}'
    if not name.startswith('aft_simple'):  # non-causal AFT-simple cannot underflow: nothing to check on any policy
        with HostSyncs() as counter:  # the 'cpu' policy checks on the host: the counter sees it
            model(images).sum().backward()
        assert counter.calls


@pytest.mark.parametrize('name', ALL_MODELS)
def test_fullgraph_compile_forward_and_backward(name):
    torch._dynamo.reset()
    model, images = small_model(name)
    expected = model(images)
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(images.double())
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
    with device_policy('cuda'):
        out = compiled(images)
        out.square().mean().backward()
    ref.assert_model_agrees(out, exact, expected, label=name)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_capture_checks_work_on_a_torch_without_compiler_is_exporting(monkeypatch):
    """torch < 2.7 has no torch.compiler.is_exporting (setup.cfg's floor is 2.5): the export check falls back to
    tracing / ONNX export / compiling, so an eager call is not mistaken for a capture and still repairs on the host.
    (torch 2.14's own module hooks and dispatch modes call is_exporting, so the bare operator is called here.)"""
    from aft_vision.layers._stable import capturing, exporting

    torch.manual_seed(0)
    q, v = torch.randn(2, 6, 6, 8), torch.randn(2, 6, 6, 8)
    k, w = 30 * torch.randn(2, 6, 6, 2), 30 * torch.randn(2, 3, 3)  # far apart: entries only the repair gets right
    repaired = aft_conv2d(q, k, v, w)
    with device_policy('cuda'):  # no host check, no repair
        unrepaired = aft_conv2d(q, k, v, w)
    assert not torch.equal(repaired, unrepaired), 'the case must need the exact repair'
    monkeypatch.delattr(torch.compiler, 'is_exporting')
    assert not exporting() and not capturing()
    torch.testing.assert_close(aft_conv2d(q, k, v, w), repaired, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Dispatch: a pure function of the device type and the shapes, one table per device type.

@pytest.mark.parametrize('device_type', ['cpu', 'cuda'])
def test_dispatch_tables_follow_the_cost_model(device_type):
    f32 = torch.float32
    choose = lambda b=8, n=14, c=384, h=384, s=15: choose_conv_method(device_type, f32, b, n, n, c, h, s)  # noqa: E731
    assert choose(n=4, c=64, h=8, b=64) == 'dense'  # the digits model: a window covering a small map
    assert choose(n=96, s=3) == 'conv'  # T = 9216 against a 3 x 3 window
    for side in range(8, 64):  # once the whole 15 x 15 window fits the map, the convolution's lead only grows
        assert [choose(n=side), choose(n=side + 1)] != ['conv', 'dense']
    for n in (8, 14, 24, 32, 48):  # a larger window, more images or fewer heads never turn dense into conv
        if choose(n=n) == 'dense':
            assert choose(n=n, s=25) == choose(n=n, b=64) == choose(n=n, h=16) == 'dense'
    assert choose(n=64, s=31, c=64, h=64, b=256) == 'conv'  # the size limit: h T^2 = 2^30 weights


def test_dispatch_differs_where_the_tables_do():
    f32 = torch.float32
    # aft_conv_small's layer at 384 px (24 x 24 tokens, h = 384, s = 15)
    assert choose_conv_method('cpu', f32, 8, 24, 24, 384, 384, 15) == 'conv'
    assert choose_conv_method('cuda', torch.bfloat16, 64, 24, 24, 384, 384, 15) == 'dense'
    assert choose_conv_method('cuda', torch.bfloat16, 64, 48, 48, 384, 384, 15) == 'conv'  # 768 px: E would be 4 GB
    shape = (8, 24, 24, 384, 384, 15)
    assert choose_conv_method('mps', f32, *shape) == choose_conv_method('cpu', f32, *shape)


class _Kernels(TorchDispatchMode):
    """Records the matrix products and the convolutions' input layouts."""

    def __init__(self):
        super().__init__()
        self.products, self.conv_channels_last = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
            self.products += 1
        if func == torch.ops.aten.convolution.default:
            self.conv_channels_last.append(args[0].is_contiguous(memory_format=torch.channels_last))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
def test_method_and_layout_follow_the_device_not_the_policy(policy):
    """On CPU tensors the 'cuda' policy runs the CPU table's method on a channels-last input, like the 'cpu' policy:
    its CUDA choices (the dense form here, a contiguous NCHW convolution) were 5-15x slower on the CPU."""
    batch, side, channels, heads, s = 64, 24, 384, 384, 15  # the 'cuda' table picks the dense form for this layer
    assert choose_conv_method('cuda', torch.float32, batch, side, side, channels, heads, s) == 'dense'
    assert choose_conv_method('cpu', torch.float32, batch, side, side, channels, heads, s) == 'conv'
    q, v = torch.randn(2, 2, side, side, channels).unbind(0)  # 2 images: the method depends on the shapes only
    k, w = torch.randn(2, side, side, heads), torch.randn(heads, s, s)
    with mock.patch('aft_vision.layers.functional.choose_conv_method',
                    lambda device_type, *rest: choose_conv_method(device_type, rest[0], batch, *rest[2:])):
        with device_policy(policy), _Kernels() as kernels:
            aft_conv2d(q, k, v, w)
    assert kernels.products == 0 and kernels.conv_channels_last == [True]


@pytest.mark.parametrize('method', ['dense', 'conv'])
def test_every_method_stays_selectable_under_both_policies(method):
    q, k, v, w = inputs('dense', 1.0, 1.0)
    problem = ref.conv_problem(q, k, v, w)
    grad_out = upstream(q)
    expected = ref.evaluate(problem, grad_out)
    for policy in ('cpu', 'cuda'):
        with device_policy(policy):
            out = {'out': aft_conv2d(q, k, v, w, method=method)}
        ref.assert_within(out, expected, ref.bound(problem, grad_out, ref.terms_for(method, policy)), policy)


def test_environment_variable_sets_the_process_default():
    code = 'import torch, aft_vision.layers as L; print(L.get_device_policy(torch.device("cpu")))'
    env = {**os.environ, 'AFT_DEVICE_POLICY': 'cuda'}
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == 'cuda', out.stderr[-2000:]
    env['AFT_DEVICE_POLICY'] = 'gpu'
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and 'AFT_DEVICE_POLICY must be one of cpu, cuda' in out.stderr


@pytest.mark.parametrize('threshold_shape', [(), (1,), (2, 1, 1, 3), (1, 4, 1, 1), (2, 4, 5, 3)])
def test_flag_below_is_the_plain_mask_or_none(threshold_shape):
    """The repair's trigger (one min reduction over the dimensions the threshold is constant along) flags exactly
    ``values < threshold``: per (image, head) thresholds with some pairs below, none below, NaN, and never under
    'cuda'."""
    from aft_vision.layers._stable import flag_below
    gen = torch.Generator().manual_seed(len(threshold_shape))
    values = torch.rand(2, 4, 5, 3, generator=gen)  # (B, H, W, h)
    threshold = torch.rand(threshold_shape, generator=gen) * 0.3
    mask = flag_below(values, threshold, 'cpu')
    expected = values < threshold
    assert expected.any() and not expected.all()  # the case flags some entries, not all
    assert mask is not None and torch.equal(mask, expected)
    assert flag_below(values, threshold - 1.0, 'cpu') is None  # nothing below
    assert flag_below(values, threshold, 'cuda') is None  # no host decision under the 'cuda' policy
    values[0, 0, 0, 0] = float('nan')
    mask = flag_below(values, threshold, 'cpu')
    assert mask is not None and torch.equal(mask, values < threshold) and not mask[0, 0, 0, 0]
    above = torch.full_like(values, 0.9)  # every entry above the threshold but one NaN: nothing to recompute
    above[1, 2, 3, 1] = float('nan')
    assert flag_below(above, threshold, 'cpu') is None


# ---------------------------------------------------------------------------------------------------------------------
# Property-based tests of the functional AFT operators: any input gives a finite result of the documented shape, equal
# to the plain reference, or a ValueError / TypeError naming the problem; images never affect each other.
# ---------------------------------------------------------------------------------------------------------------------


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])
SCALES = st.sampled_from([0.0, 1e-3, 1.0, 20.0, 1e3, 1e4])


@st.composite
def seq_case(draw):
    batch, seq_len, channels = draw(st.integers(1, 3)), draw(st.integers(1, 10)), draw(st.integers(1, 5))
    dtype, scale, seed = draw(DTYPES), draw(SCALES), draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq_len, channels, generator=gen, dtype=torch.float64) for _ in range(3))
    w = torch.randn(seq_len, seq_len, generator=gen, dtype=torch.float64) * scale
    # bias stays float32 or float64 (a parameter); tokens take the drawn dtype
    w = w.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return q.to(dtype), (k * scale).to(dtype), v.to(dtype), w


@st.composite
def grid_case(draw):
    num_heads = draw(st.integers(1, 3))
    channels = num_heads * draw(st.integers(1, 3))
    batch, height, width = draw(st.integers(1, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 6))
    s = draw(st.sampled_from([1, 3, 5, 9, 15]))
    dtype, scale, seed = draw(DTYPES), draw(SCALES), draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    q, v = (torch.randn(batch, height, width, channels, generator=gen, dtype=torch.float64) for _ in range(2))
    k = torch.randn(batch, height, width, num_heads, generator=gen, dtype=torch.float64) * scale
    w = torch.randn(num_heads, s, s, generator=gen, dtype=torch.float64) * scale
    w = w.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return q.to(dtype), k.to(dtype), v.to(dtype), w, draw(st.sampled_from(['conv', 'dense']))


def check(out, like, problem, method='dense'):
    """Shape and dtype of ``like``, finite, and within the rounding bound of ``problem``'s float64 result: sums in
    float32 (float64 for float64 inputs), the result rounded to the input dtype."""
    assert out.shape == like.shape and out.dtype == like.dtype
    accumulate = torch.float64 if like.dtype == torch.float64 else torch.float32
    ref.assert_output(out, problem, ref.terms_for(method, 'cpu'), accumulate, like.dtype)


@SETTINGS
@given(seq_case(), st.booleans(), st.integers(1, 12))
def test_sequence_operators_match_reference(case, causal, window):
    q, k, v, w = case
    check(aft_full(q, k, v, w, causal=causal), q, ref.seq_problem(q, k, v, w, 'full', causal=causal))
    check(aft_local(q, k, v, w, window, causal=causal), q,
          ref.seq_problem(q, k, v, w, 'local', window=window, causal=causal))
    check(aft_simple(q, k, v, causal=causal), q, ref.seq_problem(q, k, v, None, 'simple', causal=causal))


@SETTINGS
@given(grid_case())
def test_conv_operator_matches_reference(case):
    q, k, v, w, method = case
    check(aft_conv2d(q, k, v, w, method=method), q, ref.conv_problem(q, k, v, w), method)


@SETTINGS
@given(st.lists(st.integers(0, 6), min_size=3, max_size=5), st.lists(st.integers(0, 6), min_size=1, max_size=4),
       st.sampled_from(['full', 'simple', 'conv']))
def test_malformed_shapes_raise_value_errors_that_name_the_argument(q_shape, w_shape, op):
    q = torch.randn(q_shape)
    k = torch.randn(q_shape[:-1] + [max(1, q_shape[-1] - 1)])
    call = {
        'full': lambda: aft_full(q, k, q, torch.randn(w_shape)),
        'simple': lambda: aft_simple(q, k, q),
        'conv': lambda: aft_conv2d(q, k, q, torch.randn(w_shape)),
    }[op]
    try:
        out = call()
    except ValueError as error:
        assert any(name in str(error) for name in ('q', 'k', 'v', 'w', 'C =', 'kernel'))
    else:  # accepted: then the shapes were valid and the result is well formed
        assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize('op', ['full', 'simple', 'conv', 'dense'])
def test_nan_and_inf_stay_in_their_image(op):
    """A corrupted image may produce NaN, but only in its own output."""
    torch.manual_seed(0)
    if op in ('conv', 'dense'):
        q, v = torch.randn(2, 3, 4, 5, 6)
        k, w = torch.randn(3, 4, 5, 2), torch.randn(2, 3, 3)
        call = lambda a, b, c: aft_conv2d(a, b, c, w, method=op)  # noqa: E731
    else:
        q, k, v = torch.randn(3, 3, 7, 4)
        w = torch.randn(7, 7)
        call = (lambda a, b, c: aft_full(a, b, c, w)) if op == 'full' else aft_simple
    clean = call(q, k, v)
    for bad in (float('nan'), float('inf'), -float('inf')):
        k_bad, v_bad = k.clone(), v.clone()
        k_bad[1].view(-1)[0] = bad
        v_bad[1].view(-1)[3] = bad
        out = call(q, k_bad, v_bad)
        torch.testing.assert_close(out[0], clean[0], rtol=0, atol=0)
        torch.testing.assert_close(out[2], clean[2], rtol=0, atol=0)


@pytest.mark.parametrize('op', ['full', 'local', 'simple', 'conv', 'dense'])
def test_each_image_is_independent_of_its_batch(op):
    """Same image, alone or among others (padding included), gives the same output to float tolerance."""
    torch.manual_seed(0)
    if op in ('conv', 'dense'):
        q, v = torch.randn(2, 5, 4, 6, 8)
        k, w = torch.randn(5, 4, 6, 2) * 30, torch.randn(2, 5, 5)
        call = lambda a, b, c: aft_conv2d(a, b, c, w, method=op)  # noqa: E731
    else:
        q, k, v = torch.randn(3, 5, 9, 4)
        k = k * 30
        w = torch.randn(9, 9)
        call = {'full': lambda a, b, c: aft_full(a, b, c, w), 'local': lambda a, b, c: aft_local(a, b, c, w, 3),
                'simple': aft_simple}[op]
    batched = call(q, k, v)
    padded = call(*(torch.cat([x, torch.zeros_like(x[:2])]) for x in (q, k, v)))
    for i in range(q.shape[0]):  # each within the bound of the image's float64 result, so within twice of each other
        image = (q[i:i + 1], k[i:i + 1], v[i:i + 1])
        problem = ref.conv_problem(*image, w) if op in ('conv', 'dense') else ref.problem_for(op, *image, w)
        for out in (call(*image), batched[i:i + 1], padded[i:i + 1]):
            ref.assert_output(out, problem, ref.terms_for(op, 'cpu'), label=f'{op} image {i}')


# ---------------------------------------------------------------------------------------------------------------------
# The fused windowed AFT-conv Triton kernel (``aft_vision/layers/aft_conv_triton.py``) against a float64 reference.
#
# On a CPU-only machine the kernel runs under Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``)
# before triton builds the kernels: the cases therefore run in one subprocess, started by a module fixture, that
# executes ``triton_check.py`` (the cases and the float64 comparisons) and prints, per case, the largest ratio of each
# result's error to its rounding bound as JSON. The reference and the bound are ``aft_reference.py``'s (the float64
# definition of Eq. 6, and per entry ``gamma_n`` times the magnitude of the terms summed plus the exp arguments'
# rounding, for the split form this kernel evaluates); under the interpreter ``tl.dot`` is a numpy product, so the
# summation order is OpenBLAS's and changes with the CPU and ``OPENBLAS_CORETYPE``, which the bound allows for.
# ``MUTATIONS`` (a key dropped, the global term off by one position, the window read one offset off) must each fail
# the same check.
# ---------------------------------------------------------------------------------------------------------------------


TIMEOUT_S = 300
# On a 1 x 1 map every AFT variant returns sigmoid(q) * v whatever the weights: only a dropped key changes anything.
EQUIVALENT_MUTANTS = {('map_1x1_s3', 'global_term_off_by_one'), ('map_1x1_s3', 'window_offset_shifted')}


def _check(result, label):
    ref.assert_ratios({key: result[key] for key in ['out', 'dq', 'dk', 'dv', 'dw']}, label)


@pytest.fixture(scope='module')
def interpreter_results():
    pytest.importorskip('triton')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=root + os.pathsep + os.environ.get('PYTHONPATH', ''))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'triton_check.py')
    proc = subprocess.run([sys.executable, script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('RESULTS ')]
    assert proc.returncode == 0 and lines, f'interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
    return json.loads(lines[-1][len('RESULTS '):])


@pytest.mark.parametrize('name', list(CASES))
def test_interpreter_matches_float64_reference(interpreter_results, name):
    result = interpreter_results[name]
    assert result['dtype'] == 'torch.float32'
    _check(result, name)


@pytest.mark.parametrize('name', HALF_CASES)
def test_interpreter_float16_matches_float64_reference(interpreter_results, name):
    result = interpreter_results['_float16'][name]
    assert result['dtype'] == 'torch.float16'
    _check(result, name)


MUST_FAIL = [(name, dtype, mutation) for dtype, names in ((torch.float32, CASES), (torch.float16, HALF_CASES))
             for name in names for mutation in ref.MUTATIONS if (name, mutation) not in EQUIVALENT_MUTANTS]


@pytest.mark.parametrize('name,dtype,mutation', MUST_FAIL)
def test_the_bound_rejects_a_wrong_kernel(name, dtype, mutation):
    """A kernel with this defect, returning its exact float64 result rounded to ``dtype``, fails ``_check``."""
    problem, grad_out, expected, bounds = reference_and_bound(CASES[name], dtype)
    wrong = {key: t.to(dtype) for key, t in ref.evaluate(problem, grad_out, mutation).items()}
    with pytest.raises(AssertionError, match='its rounding bound'):
        _check(ref.excess(wrong, expected, bounds), f'{name} {mutation} (must fail)')


def test_import_does_not_load_the_kernel_module(interpreter_results):
    assert interpreter_results['_lazy_import'], 'import aft_vision imported aft_conv_triton (and so triton) eagerly'


def test_extreme_inputs_stay_finite(interpreter_results):
    assert interpreter_results['_extreme_finite']


def test_functional_method_triton_routes_here(interpreter_results):
    assert interpreter_results['_wiring'] == 0.0


def test_whole_model_on_the_triton_method_matches_the_dense_one(interpreter_results):
    """Through a whole network the error has no closed-form bound: the float32 dense (positive form) and conv (split
    form, like the kernel's) evaluations of the same weights measure this network's conditioning times float32
    rounding, and the kernel must stay within a small multiple of the worse of the two."""
    errors = interpreter_results['_model']
    assert errors['triton'] <= 4 * max(errors['dense'], errors['conv']), errors


def test_clear_error_when_triton_cannot_run(monkeypatch):
    from aft_vision.layers import aft_conv_triton
    monkeypatch.setattr(aft_conv_triton, 'triton_available', lambda: False)
    monkeypatch.setattr(aft_conv_triton, 'triton_unavailable_reason', lambda: 'triton could not be imported (test)')
    inputs = make_inputs(*CASES['borders_5x7_s3'], dtype=torch.float32)[:4]
    with pytest.raises(RuntimeError, match='triton could not be imported'):
        aft_conv_triton.aft_conv2d_triton(*inputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the CPU-only message: this machine has a CUDA device')
def test_clear_error_on_cpu_without_interpreter(monkeypatch):
    pytest.importorskip('triton')
    from aft_vision.layers import aft_conv_triton
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    assert not aft_conv_triton.triton_available()
    inputs = make_inputs(*CASES['borders_5x7_s3'], dtype=torch.float32)[:4]
    with pytest.raises(RuntimeError, match='TRITON_INTERPRET=1'):
        aft_conv_triton.aft_conv2d_triton(*inputs)


def test_rejects_bad_inputs():
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    q, k, v, w = make_inputs(*CASES['borders_5x7_s3'], dtype=torch.float32)[:4]
    with pytest.raises(ValueError):
        aft_conv2d_triton(q, k, v, w[:, :2, :2])  # even kernel size


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter does not type-check like the compiler: build the kernels to cubin for an H100 (sm_90)."""
    pytest.importorskip('triton')
    if os.environ.get('TRITON_INTERPRET', '0') == '1':
        pytest.skip('TRITON_INTERPRET=1: triton.jit returns interpreted functions')
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f'this triton has no ASTSource / GPUTarget: {exc}')
    from aft_vision.layers.aft_conv_triton import _build_kernels
    window_kernel, bias_kernel = _build_kernels()

    def build(fn, types, constexprs):
        names = list(fn.arg_names)
        signature = dict(zip(names, types))
        signature.update({name: 'constexpr' for name in constexprs})
        src = ASTSource(fn=fn, signature=signature,
                        constexprs={(names.index(name),): value for name, value in constexprs.items()})
        return triton.compile(src, target=GPUTarget('cuda', 90, 32))

    ints = ['i32'] * 6
    tiles = {'TY': 8, 'TX': 8}
    for dtype, transpose in [('fp32', False), ('bf16', True), ('fp16', False)]:
        kernel = build(window_kernel, [f'*{dtype}', '*fp32', '*fp32', '*fp32'] + ints,
                       dict(tiles, TRANSPOSE=transpose, BLOCK_K=32, BLOCK_N=64, IEEE=dtype == 'fp32'))
        assert 'cubin' in kernel.asm
    kernel = build(bias_kernel, ['*fp32', '*bf16', '*fp32'] + ints, dict(tiles, BLOCK_N=64, BLOCK_S=256))
    assert 'cubin' in kernel.asm


CUDA_REASON = 'needs a CUDA device (the compiled Triton kernel; on CPU the interpreter tests above cover it)'
CUDA_CASES = dict(CASES, small_14x14_s15=(4, 14, 14, 32, 8, 15, 1.0, 1.0, 10),
                  map_24x24_s11=(2, 24, 24, 48, 3, 11, 2.0, 1.0, 11))


def _cuda_ready():
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return os.environ.get('TRITON_INTERPRET', '0') != '1'


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
@pytest.mark.parametrize('name', list(CUDA_CASES))
def test_cuda_float32_matches_float64_reference(name):
    if not _cuda_ready():
        pytest.skip('triton is missing or TRITON_INTERPRET=1 is set')
    _check(ratios(CUDA_CASES[name], device='cuda', dtype=torch.float32), name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('name', ['borders_5x7_s3', 'window_larger_than_map_s15_4x6', 'small_14x14_s15',
                                  'map_24x24_s11'])
def test_cuda_half_matches_float64_reference(name, dtype):
    if not _cuda_ready():
        pytest.skip('triton is missing or TRITON_INTERPRET=1 is set')
    result = ratios(CUDA_CASES[name], device='cuda', dtype=dtype)
    assert result['dtype'] == str(dtype)
    _check(result, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
def test_cuda_no_host_synchronisation():
    if not _cuda_ready():
        pytest.skip('triton is missing or TRITON_INTERPRET=1 is set')
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    inputs = [t.requires_grad_(True) for t in make_inputs(*CUDA_CASES['small_14x14_s15'], device='cuda',
                                                          dtype=torch.float32)[:4]]
    aft_conv2d_triton(*inputs).sum().backward()  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        out = aft_conv2d_triton(*inputs)
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode('default')


# ---------------------------------------------------------------------------------------------------------------------
# The one-hot AFT-conv of Sec. 8 (layers.aft_conv_onehot) against the plain operator.
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('height,width,kernel,heads', [
    (1, 1, 5, 2),  # every offset but the centre falls off the map
    (2, 3, 5, 2),
    (5, 5, 7, 4),
    (7, 4, 15, 4),  # kernel larger than the map
    (12, 12, 3, 3),
    (9, 11, 5, 1),
])
def test_onehot_indexing_equals_dense_operator(height, width, kernel, heads):
    gen = torch.Generator().manual_seed(height * 100 + width)
    channels = 3 * heads
    q = torch.randn(2, height, width, channels, dtype=torch.float64, generator=gen)
    k = torch.randn(2, height, width, heads, dtype=torch.float64, generator=gen) * 3
    v = torch.randn(2, height, width, channels, dtype=torch.float64, generator=gen)
    w = torch.randn(heads, kernel, kernel, dtype=torch.float64, generator=gen) * 2
    corners = torch.tensor([0, kernel - 1, kernel * (kernel - 1), kernel * kernel - 1])
    for index in [torch.randint(0, kernel * kernel, (heads,), generator=gen), corners[torch.arange(heads) % 4],
                  torch.full((heads,), kernel * kernel // 2)]:  # random, corners (off the map), centre
        fast = aft_conv2d_onehot(q, k, v, w, index)
        bias = onehot_bias(w, index)
        assert (bias != 0).sum() <= heads
        for method in ('dense', 'conv'):
            torch.testing.assert_close(fast, aft_conv2d(q, k, v, bias, method=method), rtol=1e-10, atol=1e-12)


def test_onehot_gradients_and_extremes_match_dense():
    gen = torch.Generator().manual_seed(0)
    q, v = (torch.randn(2, 5, 6, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    k = torch.randn(2, 5, 6, 2, dtype=torch.float64, generator=gen)
    w = torch.randn(2, 5, 5, dtype=torch.float64, generator=gen)
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
    w = dense.effective_bias().detach()
    torch.testing.assert_close(layer.dense_bias(), dense.effective_bias())  # Eq. 8, as in AFTConv2d
    bias = layer.effective_bias().detach()
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
    sample = layer.effective_bias().flatten(1)
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


# ---------------------------------------------------------------------------------------------------------------------
# The channel-first form (``forward_nchw``, ``depthwise_mix_nchw``): what OpenVINO is given, held to the float64
# reference on its own, as an exported graph is (the 'cuda' policy's bound: no repair in a graph)

def _nchw(x):
    return x.permute(0, 3, 1, 2)


@pytest.mark.parametrize('shape', GRID_SHAPES)
@pytest.mark.parametrize('scale', [1.0, 3.0])
def test_channel_first_sums_match_reference(shape, scale):
    from aft_vision.layers.depthwise_mix import depthwise_mix_nchw
    q, k, v, w = grid_inputs(*shape, scale=scale)
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

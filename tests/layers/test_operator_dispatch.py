"""How an AFT-conv call is evaluated: the method a layer is built with (``set_conv_method``, ``method=``,
``mixer_kwargs``), exported graphs' convolution, and the 'auto' cost model against the methods measured fastest."""
from unittest import mock

import pytest
import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aft_reference as ref
import aft_vision  # noqa: F401  registers the models
from aft_reference import grid_inputs, inputs, upstream
from aft_vision.layers import (AFTConv2d, AFTConv2dOneHot, aft_conv2d, choose_conv_method, device_policy,
                               get_conv_method, set_conv_method)
from aft_vision.layers.functional import DISPATCH_TABLES

# One layer of each registered model, (B, H, W, C, h, s), and the method bench --ops measured fastest forward +
# backward (docs/performance.md, "The dispatch table" and "GPU"). CPU: one thread, float32, batch 8 (64 for the digits
# model; aft_conv_base at 224 px, a tie within 2%, is left out). CUDA: an H100, bfloat16, batch 64, dense
# against conv.
MEASURED = {
    'cpu': [((8, side, side, c, h, s), 'conv')
            for side in (14, 24) for c, h, s in ((384, 384, 15), (384, 16, 11), (192, 192, 11))]
    + [((8, 24, 24, 768, 32, 25), 'conv'), ((64, 2, 2, 64, 8, 5), 'dense'), ((64, 4, 4, 64, 8, 5), 'dense')],
    'cuda': [((64, side, side, c, h, s), 'dense') for side in (14, 24)
             for c, h, s in ((384, 384, 15), (384, 16, 11), (192, 192, 11), (768, 32, 25))],
}


@pytest.mark.parametrize('device_type', ['cpu', 'cuda'])
def test_dispatch_picks_the_measured_faster_method(device_type):
    for shape, fastest in MEASURED[device_type]:
        assert choose_conv_method(device_type, *shape) == fastest, (device_type, shape)


@pytest.mark.parametrize('device_type', ['cpu', 'cuda'])
def test_dispatch_tables_follow_the_cost_model(device_type):
    """A growing map turns the dense form into the convolution once and for good; where the dense form is chosen,
    a larger window, more images or fewer heads keep it. The family (64 images, C = 64, h = 8, s = 15) meets both
    methods on both tables, so every check below runs."""
    choose = lambda n, b=64, c=64, h=8, s=15: choose_conv_method(device_type, b, n, n, c, h, s)  # noqa: E731
    sweep = [choose(n) for n in range(1, 65)]
    switch = sweep.index('conv')
    assert switch > 0 and sweep == ['dense'] * switch + ['conv'] * (64 - switch), sweep
    for n in range(1, switch + 1):
        assert choose(n, s=25) == choose(n, b=128) == choose(n, h=4) == 'dense', n
    assert choose(96, b=8, c=384, h=384, s=3) == 'conv'  # T = 9216 against a 3 x 3 window
    assert choose(64, b=256, c=64, h=64, s=31) == 'conv'  # the size limit: h T^2 = 2^30 weights


def test_dispatch_differs_where_the_tables_do():
    shape = (8, 24, 24, 384, 384, 15)  # aft_conv_small's layer at 384 px
    assert choose_conv_method('cpu', *shape) == 'conv'
    assert choose_conv_method('cuda', 64, *shape[1:]) == 'dense'
    assert choose_conv_method('cuda', 64, 48, 48, 384, 384, 15) == 'conv'  # 768 px: E would be 4 GB
    assert choose_conv_method('mps', *shape) == choose_conv_method('cpu', *shape)
    assert set(DISPATCH_TABLES) == {'cpu', 'cuda'}


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
def test_the_method_follows_the_device_and_the_window_layout_the_policy(policy):
    """On CPU tensors the 'cuda' policy runs the CPU table's method, like the 'cpu' policy: its CUDA choice (the dense
    form here) was 5-15x slower on the CPU. The window form's layout is the policy's arithmetic: channels-last maps
    (oneDNN's fast path) under 'cpu', contiguous NCHW planes under 'cuda', the path the traffic count measures."""
    batch, side, channels, heads, s = 64, 24, 384, 384, 15  # the 'cuda' table picks the dense form for this layer
    assert choose_conv_method('cuda', batch, side, side, channels, heads, s) == 'dense'
    assert choose_conv_method('cpu', batch, side, side, channels, heads, s) == 'conv'
    q, k, v, w = grid_inputs(2, side, side, channels, heads, s)  # 2 images: the method depends on the shapes only
    with mock.patch('aft_vision.layers.functional.choose_conv_method',
                    lambda device_type, _batch, *rest: choose_conv_method(device_type, batch, *rest)):
        with device_policy(policy), _Kernels() as kernels:
            aft_conv2d(q, k, v, w)
    assert kernels.products == 0 and kernels.conv_channels_last == [policy == 'cpu'] * 2  # N's and D's


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


def test_a_layer_fixes_its_method_when_built():
    """As timm's ``set_fused_attn``: the global default is read when a layer is built; ``method=`` and a model's
    ``mixer_kwargs`` override it; functional calls without ``method`` read it per call."""
    q, k, v, w = grid_inputs(2, 4, 4, 8, 2, 3)  # a small map: 'auto' picks the dense form on the CPU
    before = AFTConv2d(8, 2, 3)
    assert get_conv_method() == 'auto' and before.method == 'auto'
    try:
        set_conv_method('conv')
        assert AFTConv2d(8, 2, 3).method == AFTConv2dOneHot(8, 2, 3).method == 'conv'
        assert AFTConv2d(8, 2, 3, method='dense').method == 'dense'
        model = timm.create_model('aft_conv_test', num_classes=3)
        assert {m.method for m in model.modules() if isinstance(m, AFTConv2d)} == {'conv'}
        with _Kernels() as kernels:
            aft_conv2d(q, k, v, w)
        assert kernels.products == 0 and kernels.conv_channels_last
        with pytest.raises(ValueError, match='method must be one of auto, dense, conv,'):
            set_conv_method('fft')
    finally:
        set_conv_method('auto')
    assert before.method == 'auto'
    model = timm.create_model('aft_conv_test', num_classes=3, mixer_kwargs={'method': 'dense'})
    assert {m.method for m in model.modules() if isinstance(m, AFTConv2d)} == {'dense'}
    with _Kernels() as kernels:
        aft_conv2d(q, k, v, w)
    assert kernels.products > 0 and not kernels.conv_channels_last


@pytest.mark.filterwarnings('ignore::torch.jit.TracerWarning')
@pytest.mark.parametrize('method', ['auto', 'tuned'])
def test_exported_graphs_take_the_convolution(method):
    """While exporting, 'auto' (the dense form in eager here) and 'tuned' record the depthwise convolution, which runs
    at any input size on any runtime."""
    q, k, v, w = grid_inputs(2, 4, 4, 8, 2, 3)
    traced = torch.jit.trace(lambda *t: aft_conv2d(*t, method=method), (q, k, v, w), check_trace=False)
    kinds = {node.kind() for node in traced.graph.nodes()}
    assert 'aten::_convolution' in kinds and 'aten::bmm' not in kinds, sorted(kinds)
    torch.testing.assert_close(traced(q, k, v, w), aft_conv2d(q, k, v, w, method='conv'))

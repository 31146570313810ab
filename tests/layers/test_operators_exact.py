"""The functional AFT operators (Eqs. 2, 4, 5, 6) and their bad-input errors, against ``aft_reference.py``'s float64
reference under the default 'cpu' policy: exact to rounding for any finite input (underflowed or cancelled entries are
recomputed on the host)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aft_reference as ref
from aft_reference import GRID_SHAPES, SEQ_SHAPES, grid_inputs, seq_inputs
from aft_vision.layers import AFTConv2d, AFTFull, aft_conv2d, aft_full, aft_local, aft_simple


@pytest.mark.parametrize('shape', SEQ_SHAPES)
@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('scale', [1.0, 30.0, 1e4])
def test_aft_full_matches_reference(shape, causal, scale):
    q, k, v, w = seq_inputs(*shape, scale, scale)
    ref.assert_output(aft_full(q, k, v, w, causal=causal), ref.seq_problem(q, k, v, w, 'full', causal=causal))


@pytest.mark.parametrize('shape', SEQ_SHAPES)
@pytest.mark.parametrize('window', [1, 2, 5, 100])
@pytest.mark.parametrize('causal', [False, True])
def test_aft_local_matches_reference(shape, window, causal):
    q, k, v, w = seq_inputs(*shape, 3.0, 3.0)
    ref.assert_output(aft_local(q, k, v, w, window, causal=causal),
                      ref.seq_problem(q, k, v, w, 'local', window=window, causal=causal))


@pytest.mark.parametrize('shape', SEQ_SHAPES)
@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('scale', [1.0, 1e4])
def test_aft_simple_matches_reference(shape, causal, scale):
    q, k, v, _ = seq_inputs(*shape, scale, scale)
    ref.assert_output(aft_simple(q, k, v, causal=causal), ref.seq_problem(q, k, v, None, 'simple', causal=causal))


@pytest.mark.parametrize('shape', GRID_SHAPES)
@pytest.mark.parametrize('method', ['conv', 'dense', 'auto'])
@pytest.mark.parametrize('scale', [1.0, 30.0, 1e4])
def test_aft_conv2d_matches_reference(shape, method, scale):
    q, k, v, w = grid_inputs(*shape, scale, scale)
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
        q, k, v, w = grid_inputs(2, 4, 5, 6, 3, 3, 1e4, 1e4)
    else:
        q, k, v, w = seq_inputs(2, 8, 4, 1e4, 1e4)
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
        q, k, v, w = grid_inputs(2, 4, 6, 8, 2, 5, 50.0, 50.0)
        problem = ref.conv_problem(q.bfloat16(), k.bfloat16(), v.bfloat16(), w)
        call = lambda a, b, c: aft_conv2d(a, b, c, w)  # noqa: E731
    else:
        q, k, v, w = seq_inputs(2, 10, 8, 50.0, 50.0)
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
    q, k, v, w = gradcheck_inputs(seq_inputs(2, 5, 3, scale, scale))
    assert torch.autograd.gradcheck(lambda *a: aft_full(*a, causal=True), (q, k, v, w))
    assert torch.autograd.gradcheck(lambda *a: aft_local(*a, window=2), (q, k, v, w))
    assert torch.autograd.gradcheck(lambda a, b, c: aft_simple(a, b, c, causal=True), (q, k, v))
    assert torch.autograd.gradcheck(aft_simple, (q, k, v))
    q, k, v, w = gradcheck_inputs(grid_inputs(1, 3, 4, 4, 2, 3, scale, scale))
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
    q, k, v, w = grid_inputs(2, 14, 11, 16, 4, 7, 2.0, 2.0)
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

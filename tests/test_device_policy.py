"""The CUDA behaviour of the AFT operators, proved on the CPU with ``device_policy('cuda')``, and the 'cpu' policy's
arithmetic beside it.

Under the 'cuda' policy the operators copy nothing to the host, run their matrix products in the autocast dtype and
save only their inputs for the backward pass; the 'cpu' policy runs them in bfloat16 under bfloat16 and repairs what
underflowed or cancelled, for any finite input. Accuracy is held to aft_reference.py's plain float64 softmax over the
joint logits ``k + w`` (Eqs. 2, 4, 5 and 6, independent of the package), gradients included; host syncs are
counted at the dispatcher over whole models; graph capture is checked with ``torch.compile(fullgraph=True)``.
"""
import contextlib
import copy
import os
from unittest import mock
import subprocess
import sys

import pytest
import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aft_vision  # noqa: F401  (registers the models)
from aft_vision.layers import aft_conv2d, aft_full, aft_local, aft_simple, choose_conv_method, device_policy
from aft_vision.layers import functional
from aft_vision.layers.policy import get_device_policy

import aft_reference as ref

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
CAUSAL = ('causal', 'simple_causal')


def inputs(op, key_scale, bias_scale, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if op in ('dense', 'conv'):
        batch, height, width, channels, num_heads, s = 2, 5, 6, 8, 4, 5
        q, v = torch.randn(2, batch, height, width, channels, generator=gen)
        k = torch.randn(batch, height, width, num_heads, generator=gen)
        w = torch.randn(num_heads, s, s, generator=gen)
    else:
        q, k, v = torch.randn(3, 2, 9, 6, generator=gen)
        w = torch.randn(9, 9, generator=gen)
    return q, k * key_scale, v, w * bias_scale


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

CASES = [('cuda', 1.0, 1.0), ('cuda', 20.0, 3.0), ('cpu', 1.0, 1.0), ('cpu', 20.0, 3.0), ('cpu', 60.0, 40.0)]


@pytest.mark.parametrize('op', OPS)
@pytest.mark.parametrize('policy,key_scale,bias_scale', CASES)
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

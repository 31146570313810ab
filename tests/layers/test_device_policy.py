"""The two device policies of the AFT operators, the CUDA one proved on the CPU with ``device_policy('cuda')``.

Under 'cuda' the operators copy nothing to the host and run their matrix products in the autocast dtype; under 'cpu'
they take bfloat16 products under bfloat16 and repair what underflowed or cancelled, for any finite input. Outputs and
all four gradients are held to aft_reference.py's float64 softmax over the joint logits ``k + w``; both policies save
only the operators' inputs for the backward pass.
"""
import contextlib
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aft_reference as ref
from aft_reference import CAUSAL, inputs, upstream
from aft_vision.layers import aft_conv2d, aft_full, aft_local, aft_simple, device_policy, functional, get_device_policy


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
    """Why the products take 16 bits in bfloat16 only: float16's range (normal above 2^-14) turns the softmax-scaled
    weights into zeros and subnormals, and the result leaves its bound (or is not finite)."""
    q, k, v, w = inputs(op, 60.0, 40.0)
    grad_out = upstream(q).to(torch.bfloat16)
    real_plan = functional._plan

    def float16_products(*args):
        plan = real_plan(*args)
        return plan[:2] + (torch.float16,) + plan[3:]

    with device_policy('cpu'), mock.patch('aft_vision.layers.functional._plan', float16_products):
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
    ('cuda', torch.bfloat16, torch.bfloat16), ('cuda', torch.float16, torch.float32),  # float16 underflows there
    ('cpu', torch.bfloat16, torch.bfloat16), ('cpu', torch.float16, torch.float32),
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
# Training memory: the operators save their inputs for the backward pass; the products form instead sigmoid(q), X
# and D, the bytes of q, k, v and one more key-sized tensor (X holds k's and v's sizes); the window form sigmoid(q),
# p v, p and D the same way, and its kernels.

@pytest.mark.parametrize('op', OPS)
@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
def test_operators_save_only_their_inputs(op, policy):
    q, k, v, w = (x.requires_grad_(True) for x in inputs(op, 1.0, 1.0))
    storages = set()

    def pack(tensor):
        storages.add((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        return tensor

    with device_policy(policy), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call(op, q, k, v, w)
    storages.discard((out.untyped_storage().data_ptr(), out.untyped_storage().nbytes()))  # the next layer keeps it
    allowed = q[..., :1].numel() * 8  # at most a per-row statistic beside the inputs
    if op in ('full', 'causal', 'local', 'dense', 'conv'):  # the products form: D (key-sized) and the bias table
        allowed += k.numel() * k.element_size() + w.numel() * 8
    if op == 'conv':  # the window form: its depthwise kernels, (C + h) s^2 floats
        allowed += (q.shape[-1] + k.shape[-1]) * w[0].numel() * 4
    if op == 'local':  # aft_local zeroes the bias outside the window first: the windowed (T, T) bias and its mask
        allowed += w.numel() * (w.element_size() + 1)
    inputs_bytes = sum(x.untyped_storage().nbytes() for x in (q, k, v, w))
    saved_bytes = sum(nbytes for _, nbytes in storages)
    own = {x.untyped_storage().data_ptr() for x in (q, k, v, w)}
    extra = sum(nbytes for ptr, nbytes in storages if ptr not in own)
    assert saved_bytes <= inputs_bytes + allowed
    if op not in ('full', 'causal', 'local', 'dense', 'conv'):  # the other forms keep the inputs themselves
        assert extra <= allowed


@pytest.mark.parametrize('name,value,read', [
    ('AFT_DEVICE_POLICY', 'CUDA', 'L.get_device_policy(torch.device("cpu"))'),
    ('AFT_CONV_METHOD', 'Dense', 'L.get_conv_method()'),
])
def test_environment_variables_set_the_process_default(name, value, read):
    """Read in any case once, at import, as timm reads TIMM_FUSED_ATTN (a later change of the variable changes
    nothing); a bad value never stops the import, it is the error of each call that needs it, in one line naming the
    variable."""
    code = (f'import os, torch, aft_vision.layers as L; print({read})\n'
            f'os.environ["{name}"] = "gpu"\n'
            f'print({read})')
    out = subprocess.run([sys.executable, '-c', code], env={**os.environ, name: value}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [value.lower(), value.lower()]
    code = (f'import torch, aft_vision.layers as L\n'
            f'for _ in range(2):\n    try:\n        {read}\n    except ValueError as error:\n        print(error)')
    out = subprocess.run([sys.executable, '-c', code], env={**os.environ, name: 'gpu'}, capture_output=True,
                         text=True, timeout=120)
    errors = out.stdout.strip().splitlines()
    assert len(errors) == 2 and all(e.startswith(f'{name} must be one of ') and "got 'gpu'" in e for e in errors)


@pytest.mark.parametrize('threshold_shape', [(), (1,), (2, 1, 1, 3), (1, 4, 1, 1), (2, 4, 5, 3)])
def test_flag_below_is_the_plain_mask_or_none(threshold_shape):
    """The repair's trigger (one min reduction over the dimensions the threshold is constant along) flags exactly
    ``values < threshold``: per (image, head) thresholds with some pairs below, none below, NaN, and never under
    'cuda'."""
    from aft_vision.layers.functional import flag_below
    gen = torch.Generator().manual_seed(len(threshold_shape))
    values = torch.rand(2, 4, 5, 3, generator=gen)  # (B, H, W, h)
    threshold = torch.rand(threshold_shape, generator=gen) * 0.3
    mask = flag_below(values, threshold)
    expected = values < threshold
    assert expected.any() and not expected.all()  # the case flags some entries, not all
    assert mask is not None and torch.equal(mask, expected)
    assert flag_below(values, threshold - 1.0) is None  # nothing below
    values[0, 0, 0, 0] = float('nan')
    mask = flag_below(values, threshold)
    assert mask is not None and torch.equal(mask, values < threshold) and not mask[0, 0, 0, 0]
    above = torch.full_like(values, 0.9)  # every entry above the threshold but one NaN: nothing to recompute
    above[1, 2, 3, 1] = float('nan')
    assert flag_below(above, threshold) is None

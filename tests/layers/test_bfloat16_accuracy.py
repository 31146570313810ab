"""Every AFT operator form is right in bfloat16 under either policy: no method, policy or autograd form (the
``autograd.Function`` or the plain one of exports, compile and higher derivatives) is less accurate than the products
form on the same rounded inputs beyond what rounding explains.

At the scales trained models reach (keys up to 20, biases up to 3), on maps from 5 x 6 to 14 x 14 with windows 3 to 15,
each form's output and four gradients lie within ``aft_reference.bound``: twelve roundings per term in float32 on the
terms as the form sums them, the bfloat16 ones on the positive terms only (the window form's split sums are float32,
so their cancellation never amplifies a bfloat16 rounding; the plain forms scale E and p by a detached maximum, not a
softmax, whose gradient would subtract a sum that is zero but for rounding from every entry). The output also stays
within 2% of its largest magnitude against the float64 result of the same bfloat16-rounded inputs, as the products
form does. The sequence operators (AFT-full, -local, -simple, causal or not) are held to the same bound, the 'cpu'
policy also far beyond (keys 60, biases 40), where its host repair recomputes entries.
"""
import itertools

import pytest
import torch

import aft_reference as ref
from aft_vision.layers import aft_conv2d, aft_full, aft_local, aft_simple, device_policy, plain_autograd

# (B, H, W, C, h, s): the smallest and largest maps, windows 3 to 15, one and several channels per head
SHAPES = [(2, 5, 6, 8, 8, 3), (2, 7, 7, 16, 4, 7), (1, 9, 11, 12, 12, 11), (2, 14, 14, 16, 16, 15)]
SCALES = [(1.0, 1.0), (5.0, 2.0), (20.0, 3.0)]  # (key scale, bias scale)
FORMS = list(itertools.product(('dense', 'conv'), ('cpu', 'cuda'), (False, True)))  # method, policy, plain autograd
SCALE_TOL = 2e-2  # of the output's largest magnitude


def run_in_bfloat16(q, k, v, w, grad_out, method, policy, plain):
    """Output and q / k / v / w gradients of ``aft_conv2d`` under bfloat16 autocast, q, k, v handed over in bfloat16
    as a model's linear layer hands them."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, w)]
    with device_policy(policy), plain_autograd(plain), torch.autocast('cpu', dtype=torch.bfloat16):
        out = aft_conv2d(*(x.bfloat16() for x in leaves[:3]), leaves[3], method=method)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return dict(zip(('out',) + ref.GRADS, (out,) + grads))


@pytest.mark.parametrize('shape', SHAPES, ids=lambda s: 'x'.join(map(str, s)))
@pytest.mark.parametrize('key_scale,bias_scale', SCALES)
def test_every_form_is_within_the_rounding_bound_in_bfloat16(shape, key_scale, bias_scale):
    q, k, v, w = ref.grid_inputs(*shape, key_scale=key_scale, bias_scale=bias_scale)
    grad_out = ref.upstream(q).bfloat16()
    problem = ref.conv_problem(q.bfloat16(), k.bfloat16(), v.bfloat16(), w)
    exact = ref.evaluate(problem, grad_out)
    for method, policy, plain in FORMS:
        results = run_in_bfloat16(q, k, v, w, grad_out, method, policy, plain)
        terms = 'positive' if method == 'dense' else ('split_repaired' if policy == 'cpu' and not plain else 'split')
        bounds = ref.bound(problem, grad_out, terms, torch.float32, torch.bfloat16)
        ref.assert_within(results, exact, bounds, f'{method} {policy} plain={plain}')


# the cases of the report that found the bfloat16 window form off by up to 290% of its output
REPORTED = [((2, 5, 6, 8, 8, 3), 20.0, 3.0), ((2, 14, 14, 16, 16, 15), 5.0, 2.0), ((2, 14, 14, 16, 16, 15), 20.0, 3.0)]


@pytest.mark.parametrize('shape,key_scale,bias_scale', REPORTED)
@pytest.mark.parametrize('method,policy,plain', FORMS)
def test_output_within_two_percent_of_its_scale_in_bfloat16(shape, key_scale, bias_scale, method, policy, plain):
    q, k, v, w = ref.grid_inputs(*shape, key_scale=key_scale, bias_scale=bias_scale, seed=3)
    problem = ref.conv_problem(q.bfloat16(), k.bfloat16(), v.bfloat16(), w)
    exact = ref.evaluate(problem, ref.upstream(q))['out']
    out = run_in_bfloat16(q, k, v, w, ref.upstream(q), method, policy, plain)['out']
    error = (out.double() - exact).abs().max() / exact.abs().max()
    assert error <= SCALE_TOL, f'{method} {policy} plain={plain}: {error:.3g} of the output scale'


SEQ_OPS = {
    'full': lambda q, k, v, w: aft_full(q, k, v, w),
    'causal': lambda q, k, v, w: aft_full(q, k, v, w, causal=True),
    'local': lambda q, k, v, w: aft_local(q, k, v, w, 5),
    'simple': lambda q, k, v, w: aft_simple(q, k, v),
    'simple_causal': lambda q, k, v, w: aft_simple(q, k, v, causal=True),
}
# the 'cuda' policy's stated range: causal prefixes within ~50 of the largest key (docs/operators.md)
SEQ_CASES = [(policy, key_scale, bias_scale) for policy in ('cpu', 'cuda')
             for key_scale, bias_scale in SCALES + [(60.0, 40.0)] if policy == 'cpu' or bias_scale <= 3.0]


@pytest.mark.parametrize('op', SEQ_OPS)
@pytest.mark.parametrize('policy,key_scale,bias_scale', SEQ_CASES)
@pytest.mark.parametrize('plain', [False, True])
def test_sequence_operators_within_the_rounding_bound_in_bfloat16(op, policy, key_scale, bias_scale, plain):
    if policy == 'cuda' and op in ref.CAUSAL:
        key_scale = min(key_scale, 5.0)
    q, k, v, w = ref.seq_inputs(2, 30, 8, key_scale, bias_scale)
    grad_out = ref.upstream(q).bfloat16()
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, w)]
    with device_policy(policy), plain_autograd(plain), torch.autocast('cpu', dtype=torch.bfloat16):
        out = SEQ_OPS[op](*(x.bfloat16() for x in leaves[:3]), leaves[3])
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    problem = ref.problem_for(op, q.bfloat16(), k.bfloat16(), v.bfloat16(), w, window=5)
    bounds = ref.bound(problem, grad_out, ref.terms_for(op, policy), torch.float32, torch.bfloat16)
    results = dict(zip(('out',) + ref.GRADS, (out,) + grads))
    ref.assert_within(results, ref.evaluate(problem, grad_out), bounds, f'{op} {policy} plain={plain}')

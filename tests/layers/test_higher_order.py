"""Higher-order autograd and torch.func on every AFT operator form, in float64 on tiny shapes. Second derivatives
(``create_graph=True``) held to finite differences (``gradgradcheck``) and to aft_reference.py's dense softmax (a
gradient penalty's gradient), under ``plain_autograd()`` and without it where the form has them; a form whose backward
has none refuses in one line that names the switch. ``torch.func.grad``, ``vmap`` (per-sample gradients), ``jacrev``
and ``hessian`` against plain autograd under either policy. Then the R1 penalty (the squared input gradient) of the
tiny models, against central differences (torch.func on the models: tests/models/test_func.py)."""
from unittest import mock

import pytest
import timm
import torch

import aft_reference as ref
import aft_vision  # noqa: F401  registers the models
from aft_vision.layers import aft_conv2d, aft_conv2d_onehot, aft_full, aft_local, aft_simple, device_policy, \
    _shared, functional, plain_autograd
from aft_vision.layers.aft_conv_onehot import onehot_bias

ONEHOT_INDEX = torch.tensor([4, 2])  # one flat offset of the 3 x 3 window per head: the centre, a corner

# operator form -> (the call, the reference's Problem kind, how w reaches the reference's bias)
FORMS = {
    'full': (lambda q, k, v, w: aft_full(q, k, v, w), 'full'),
    'causal': (lambda q, k, v, w: aft_full(q, k, v, w, causal=True), 'causal'),
    'local': (lambda q, k, v, w: aft_local(q, k, v, w, 3), 'local'),
    'simple': (lambda q, k, v, w: aft_simple(q, k, v), 'simple'),
    'simple_causal': (lambda q, k, v, w: aft_simple(q, k, v, causal=True), 'simple_causal'),
    'dense': (lambda q, k, v, w: aft_conv2d(q, k, v, w, method='dense'), 'dense'),
    'conv': (lambda q, k, v, w: aft_conv2d(q, k, v, w, method='conv'), 'conv'),
    'auto': (lambda q, k, v, w: aft_conv2d(q, k, v, w, method='auto'), 'conv'),
    'onehot': (lambda q, k, v, w: aft_conv2d_onehot(q, k, v, w, ONEHOT_INDEX), 'conv'),
}
# forms whose own backward has second derivatives; the others (the products and the window) refuse create_graph
DIFFERENTIABLE_TWICE = ('simple', 'simple_causal', 'onehot')


def form_inputs(form, key_scale=1.0, bias_scale=1.0, batch=1):
    """Tiny float64 leaves q, k, v, w of ``form``: T = 5 tokens of C = 2, or a 3 x 3 map of C = 4 in h = 2 heads with
    a 3 x 3 window (AFT-simple has no w)."""
    if FORMS[form][1] in ('dense', 'conv'):
        tensors = ref.grid_inputs(batch, 3, 3, 4, 2, 3, key_scale, bias_scale, dtype=torch.float64)
    else:
        tensors = ref.seq_inputs(batch, 5, 2, key_scale, bias_scale, dtype=torch.float64)
    tensors = tensors[:3] if form.startswith('simple') else tensors
    return [t.clone().requires_grad_(True) for t in tensors]


def call(form, leaves):
    return FORMS[form][0](*leaves, *([None] * (4 - len(leaves))))


def reference(form, leaves):
    """The form's output by the reference's dense float64 softmax, differentiable in the leaves."""
    q, k, v = leaves[:3]
    w = leaves[3] if len(leaves) > 3 else None
    if form == 'onehot':
        w = onehot_bias(w, ONEHOT_INDEX)
    problem = ref.problem_for(FORMS[form][1], q, k, v, w, window=3)
    flat = [x.reshape(x.shape[0], -1, x.shape[-1]) for x in (q, k, v)]  # (B, T, .) token rows
    return ref._mix(problem, *flat, w)[0].reshape(q.shape)


def penalty_gradient(forward, leaves, grad_out):
    """The gradient in the leaves of ``sum |dL/dx|^2`` over the leaves x, ``L = <forward(leaves), grad_out>``."""
    grads = torch.autograd.grad(forward(leaves), leaves, grad_out, create_graph=True)
    return torch.autograd.grad(sum((g ** 2).sum() for g in grads), leaves)


@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
@pytest.mark.parametrize('form', list(FORMS))
def test_plain_autograd_gives_second_derivatives(form, policy, one_thread):
    leaves = form_inputs(form)
    with device_policy(policy), plain_autograd():
        assert torch.autograd.gradgradcheck(lambda *x: call(form, x), leaves, fast_mode=True)


@pytest.mark.parametrize('form', list(FORMS))
def test_default_forms_give_second_derivatives_or_refuse(form, one_thread):
    leaves = form_inputs(form)
    if form in DIFFERENTIABLE_TWICE:
        assert torch.autograd.gradgradcheck(lambda *x: call(form, x), leaves, fast_mode=True)
    else:  # one line that names the switch
        with pytest.raises(RuntimeError, match=r'^[^\n]*plain_autograd\(\)[^\n]*$'):
            torch.autograd.grad(call(form, leaves).sum(), leaves, create_graph=True)


@pytest.mark.parametrize('plain', [True, False])
@pytest.mark.parametrize('form', list(FORMS))
def test_gradient_penalty_matches_reference(form, plain, one_thread):
    """A gradient penalty's gradient (once 3.5e-2 off through AFT-simple) equals the reference's: both
    float64, the forms' arguments below ~10, so rounding leaves ~1e-13 of the largest entry (1e-9 allowed)."""
    if not plain and form not in DIFFERENTIABLE_TWICE:
        pytest.skip('refuses create_graph (test_default_forms_give_second_derivatives_or_refuse)')
    leaves = form_inputs(form)
    grad_out = ref.upstream(leaves[0])
    with plain_autograd(plain):
        got = penalty_gradient(lambda x: call(form, x), leaves, grad_out)
    for name, g, want in zip('qkvw', got, penalty_gradient(lambda x: reference(form, x), leaves, grad_out)):
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-9 * want.abs().max().item(), msg=f'{form} d{name}')


@pytest.mark.parametrize('form', ['full', 'causal', 'simple_causal', 'dense', 'conv'])
def test_repaired_entries_have_second_derivatives(form, one_thread):
    """Under 'cpu' at key scale 60 and bias scale 40 the shifted sums underflow (or cancel) and the entries are
    recomputed exactly; inside ``plain_autograd()`` that recomputation is differentiated twice as well. Arguments reach
    ~300: float64 rounding ~1e-13 relative, 1e-8 allowed."""
    leaves = form_inputs(form, 60.0, 40.0)
    grad_out = ref.upstream(leaves[0])
    recompute = mock.patch('aft_vision.layers.functional.recompute_flagged', wraps=functional.recompute_flagged)
    with device_policy('cpu'), plain_autograd(), recompute as recomputed:
        got = penalty_gradient(lambda x: call(form, x), leaves, grad_out)
    assert recomputed.called
    for name, g, want in zip('qkvw', got, penalty_gradient(lambda x: reference(form, x), leaves, grad_out)):
        torch.testing.assert_close(g, want, rtol=1e-8, atol=1e-8 * want.abs().max().item(), msg=f'{form} d{name}')


def test_plain_autograd_is_a_thread_local_switch_and_a_decorator():
    leaves = form_inputs('conv')

    @plain_autograd()
    def twice():
        return torch.autograd.grad(call('conv', leaves).sum(), leaves, create_graph=True)

    assert all(g.requires_grad for g in twice())
    with plain_autograd():
        with plain_autograd(False):
            assert not _shared.plain_forms()
        assert _shared.plain_forms()
        seen = []
        thread = __import__('threading').Thread(target=lambda: seen.append(_shared.plain_forms()))
        thread.start()
        thread.join()
        assert seen == [False]
    assert not _shared.plain_forms()


def assert_close64(got, want, label):
    """Two float64 evaluations of one derivative (the Functions' backward, the plain forms): rounding apart."""
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10 * want.abs().max().item(), msg=label)


@pytest.mark.parametrize('policy', ['cpu', 'cuda'])
@pytest.mark.parametrize('form', list(FORMS))
def test_torch_func_transforms_match_autograd(form, policy, one_thread):
    """``grad``, ``vmap(grad)`` per sample, ``jacrev`` and ``hessian`` equal plain autograd (the default forms' own
    backward, one sample at a time; the hessian: the reference's). Under a transform every form takes its plain form
    with the 'cuda' policy's behaviour whatever the policy in force: the 'cpu' policy's host check would fail on
    batched tensors."""
    q, k, v, *w = [x.detach() for x in form_inputs(form, batch=3)]  # w: [] or [w], shared by the samples
    g = ref.upstream(q)
    argnums = (0, 1, 2) + tuple(range(4, 4 + len(w)))  # q, k, v and w, not g

    def loss(q, k, v, g, *w):  # <output, g>
        return (call(form, [q, k, v, *w]) * g).sum()

    def sample_loss(q, k, v, g, *w):  # one sample without its batch dim
        return loss(q[None], k[None], v[None], g[None], *w)

    with device_policy(policy):
        batch = torch.func.grad(loss, argnums)(q, k, v, g, *w)
        per_sample = torch.func.vmap(torch.func.grad(sample_loss, argnums),
                                     in_dims=(0, 0, 0, 0) + (None,) * len(w))(q, k, v, g, *w)
        jacobian = torch.func.jacrev(lambda k1: call(form, [q[:1], k1, v[:1], *w]))(k[:1])
        hessian = torch.func.hessian(lambda k1: loss(q[:1], k1, v[:1], g[:1], *w))(k[:1])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, *w)]
    for name, got, want in zip('qkvw', batch, torch.autograd.grad(loss(*leaves[:3], g, *leaves[3:]), leaves)):
        assert_close64(got, want, f'{form} grad d{name}')
    for b in range(3):
        sample = [x[b:b + 1].clone().requires_grad_(True) for x in (q, k, v)] + leaves[3:]
        wants = torch.autograd.grad(loss(*sample[:3], g[b:b + 1], *sample[3:]), sample)
        for name, got, want in zip('qkvw', per_sample, wants):
            assert_close64(got[b], want[0] if name != 'w' else want, f'{form} vmap d{name}[{b}]')
    rows = torch.autograd.functional.jacobian(lambda k1: call(form, [q[:1], k1, v[:1], *w]), k[:1])
    assert_close64(jacobian, rows, f'{form} jacrev')
    exact = torch.autograd.functional.hessian(lambda k1: (reference(form, [q[:1], k1, v[:1], *w]) * g[:1]).sum(),
                                              k[:1])
    assert_close64(hessian, exact, f'{form} hessian')


def tiny_model(name):
    """``name`` in float64 at 16 x 16 pixels (a 2 x 2 patch grid), two blocks, three classes."""
    return timm.create_model(name, img_size=16, depth=2, num_classes=3).double()


def r1_penalty(model, images):
    """R1: the squared gradient of the summed first logit in the images, with its graph."""
    (grad,) = torch.autograd.grad(model(images)[:, 0].sum(), images, create_graph=True)
    return grad.square().sum()


@pytest.mark.parametrize('name', ['aft_conv_test', 'aft_full_test', 'aft_simple_test'])
def test_r1_penalty_gradient_matches_central_differences(name, one_thread):
    """The R1 penalty's parameter gradient under ``plain_autograd()`` against a central difference along a random
    direction u (step 1e-5: truncation ~1e-10, rounding ~1e-11 relative; 1e-6 allowed). Without the switch
    AFT-simple (once up to 23% off) gives the same gradient, AFT-conv and AFT-full refuse in one line."""
    torch.manual_seed(0)
    model = tiny_model(name)
    images = torch.randn(2, 3, 16, 16, dtype=torch.float64, requires_grad=True)
    params = list(model.parameters())
    with plain_autograd():
        grads = torch.autograd.grad(r1_penalty(model, images), params, materialize_grads=True)  # head bias: unused
    direction = [torch.randn_like(p) for p in params]
    step, sides = 1e-5, []
    for sign in (1, -1):
        with torch.no_grad():
            for p, u in zip(params, direction):
                p.add_(u, alpha=sign * step)
        with plain_autograd():
            sides.append(r1_penalty(model, images).item())
        with torch.no_grad():
            for p, u in zip(params, direction):
                p.sub_(u, alpha=sign * step)
    numeric = (sides[0] - sides[1]) / (2 * step)
    analytic = sum((g * u).sum() for g, u in zip(grads, direction)).item()
    assert abs(analytic - numeric) <= 1e-6 * abs(numeric), (analytic, numeric)
    if name == 'aft_simple_test':
        for g, want in zip(torch.autograd.grad(r1_penalty(model, images), params, materialize_grads=True), grads):
            torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-10 * want.abs().max().item())
    else:
        with pytest.raises(RuntimeError, match=r'^[^\n]*plain_autograd\(\)[^\n]*$'):
            r1_penalty(model, images)

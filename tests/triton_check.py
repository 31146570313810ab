"""Not a test: the Triton kernel's cases, run by Triton's interpreter in a subprocess of
tests/layers/test_triton_kernel.py (its ``interpreter_results`` fixture), since ``TRITON_INTERPRET=1`` must be set
before triton builds the kernels.

``python tests/triton_check.py`` (with ``TRITON_INTERPRET=1`` on a CPU) prints one line, ``RESULTS {json}``: per case,
the largest ratio of each result's error to its rounding bound (``aft_reference.py``'s), and the float16, lazy-import,
extreme-input, wiring and whole-model checks. test_triton_kernel.py also takes the cases and the comparisons from here.
"""
import json
import sys

import torch

import aft_reference as ref
import aft_vision  # noqa: F401  registers the models (and must not import the kernel module)

# name: (batch, height, width, channels, heads, kernel size, key scale, bias scale, seed)
CASES = {
    'borders_5x7_s3': (2, 5, 7, 4, 2, 3, 1.0, 1.0, 0),
    'window_larger_than_map_s15_4x6': (2, 4, 6, 4, 2, 15, 1.0, 1.0, 1),
    'one_head': (2, 5, 5, 3, 1, 3, 1.0, 1.0, 2),
    'head_per_channel': (2, 6, 5, 4, 4, 5, 1.0, 1.0, 3),
    'kernel_1_non_square': (2, 3, 9, 4, 2, 1, 1.0, 1.0, 4),
    'tiles_and_channel_blocks_10x9': (3, 10, 9, 44, 1, 3, 1.0, 1.0, 5),
    'map_1x1_s3': (2, 1, 1, 2, 1, 3, 1.0, 1.0, 6),
    'key_scale_20_bias_scale_3': (2, 5, 6, 4, 2, 3, 20.0, 3.0, 7),
    'kernel_31_3x5': (1, 3, 5, 2, 1, 31, 1.0, 1.0, 8),
}
# Extreme keys and biases (a bias range below ~87, where the denominator cannot underflow): finite, not exact.
EXTREME = (2, 6, 7, 4, 2, 5, 1e4, 40.0, 9)
HALF_CASES = ['borders_5x7_s3', 'window_larger_than_map_s15_4x6', 'key_scale_20_bias_scale_3']


def case_inputs(case, device='cpu', dtype=torch.float32):
    """``aft_reference.grid_inputs`` of a case, rounded to ``dtype``, and a float64 upstream gradient rounded alike."""
    q, k, v, w = ref.grid_inputs(*case, dtype=dtype, device=device)
    return q, k, v, w, ref.upstream(q, seed=123).to(device=device, dtype=dtype)


def reference_and_bound(case, dtype):
    """The float64 results on the ``dtype``-rounded inputs (the kernel's error, not the inputs' rounding) and their
    bounds for the split form, accumulated in float32 with operands in ``dtype``."""
    q, k, v, w, grad_out = case_inputs(case, dtype=dtype)
    problem = ref.conv_problem(q, k, v, w)
    return problem, grad_out, ref.evaluate(problem, grad_out), ref.bound(
        problem, grad_out, 'split', torch.float32, dtype)


def ratios(case, device='cpu', dtype=torch.float32):
    """Largest error-to-bound ratio of the kernel's output and q / k / v / w gradients (inputs in ``dtype``)."""
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    _, grad_out, expected, bounds = reference_and_bound(case, dtype)
    inputs = [t.to(device).requires_grad_(True) for t in case_inputs(case, dtype=dtype)[:4]]
    out = aft_conv2d_triton(*inputs)
    grads = torch.autograd.grad(out, inputs, grad_out.to(device))
    results = {name: t.cpu() for name, t in zip(['out', 'dq', 'dk', 'dv', 'dw'], (out,) + grads)}
    return dict(ref.excess(results, expected, bounds), dtype=str(out.dtype), shape=list(out.shape))


def _finite(case):
    """Whether the kernel's output and gradients are finite for keys and biases of large magnitude."""
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    q, k, v, w, _ = case_inputs(case, dtype=torch.float64)
    w = case[7] * (2.0 * torch.rand(w.shape, generator=torch.Generator().manual_seed(case[8]), dtype=w.dtype) - 1.0)
    tri_in = [t.float().requires_grad_(True) for t in (q, k, v, w)]
    out = aft_conv2d_triton(*tri_in)
    grads = torch.autograd.grad(out.sum(), tri_in)
    return all(bool(torch.isfinite(t).all()) for t in (out,) + grads)


def _wiring(case):
    """``aft_conv2d(..., method='triton')`` against this kernel called directly."""
    from aft_vision.layers import functional
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    inputs = case_inputs(case)[:4]
    routed = functional.aft_conv2d(*inputs, method='triton')
    return (routed - aft_conv2d_triton(*inputs)).abs().max().item()


def _whole_model():
    """A small registered model with ``mixer_kwargs={'method': 'triton'}``, and the same weights on the dense and conv
    methods in float32, each against the dense method in float64: per method, the largest error of the output and of
    every parameter gradient, relative to that tensor's largest float64 entry."""
    import timm
    torch.manual_seed(0)
    kwargs = dict(img_size=48, num_classes=5, patch_size=8, kernel_size=5)
    methods = ('triton', 'dense', 'conv', 'exact')
    models = {method: timm.create_model('aft_conv_test', mixer_kwargs={'method': 'dense' if method == 'exact' else
                                                                       method}, **kwargs) for method in methods}
    for name, param in models['triton'].named_parameters():  # a trained-looking bias (Eq. 8's gamma and beta start 0)
        if 'pos_gamma' in name or 'pos_beta' in name:
            torch.nn.init.normal_(param)
    for method in methods[1:]:
        models[method].load_state_dict(models['triton'].state_dict())
    models['exact'].double()
    images = torch.randn(2, 3, 48, 48, dtype=torch.float64)
    tensors = {}
    for method, model in models.items():
        out = model(images.to(next(model.parameters()).dtype))
        out.square().sum().backward()
        tensors[method] = [out] + [p.grad for p in model.parameters()]
    exact = tensors.pop('exact')
    return {method: max(((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()
                        for got, want in zip(got_all, exact)) for method, got_all in tensors.items()}


def main():
    """Run every case (call with TRITON_INTERPRET=1 on CPU) and print the results as one JSON line."""
    lazy = 'aft_vision.layers.aft_conv_triton' not in sys.modules
    torch.manual_seed(0)
    results = {name: ratios(case) for name, case in CASES.items()}
    # float16 is faithful under the interpreter (bfloat16 tl.dot is not): it covers the half-operand path
    results['_float16'] = {name: ratios(CASES[name], dtype=torch.float16) for name in HALF_CASES}
    results['_lazy_import'] = lazy
    results['_extreme_finite'] = _finite(EXTREME)
    results['_wiring'] = _wiring(CASES['borders_5x7_s3'])
    results['_model'] = _whole_model()
    print('RESULTS ' + json.dumps(results))


if __name__ == '__main__':
    main()

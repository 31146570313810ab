"""Not a test: the fused operator's cases, run by Triton's interpreter in a subprocess of
tests/layers/test_fused_operator.py (its ``interpreter_results`` fixture): ``TRITON_INTERPRET=1`` must be set before
triton builds the kernels.

``TRITON_INTERPRET=1 python tests/fused_check.py`` prints one line, ``RESULTS {json}``: per case and dtype, the largest
ratio of each result's error to its rounding bound (``aft_reference.py``'s, for sums of positive terms), then
gradcheck in float64, the routing from ``aft_conv2d`` and a whole model against the float64 dense method.

The interpreter checks every int32 add, sub and mul of the kernels for overflow (its ``sanitize_overflow`` option,
half of its time here). It runs for the float32 cases, which compute every index of every case; the 16-bit runs
compute the same indices as their float32 case, and gradcheck and the model only smaller ones, so they run without it.
"""
import contextlib
import dataclasses
import json
import sys

import torch

import aft_reference as ref
import aft_vision  # noqa: F401  registers the models (and must not import the kernel module)

# name: (batch, height, width, channels, heads, kernel size, key scale, bias scale, seed)
CASES = {
    'borders_5x7_s3': (2, 5, 7, 4, 2, 3, 1.0, 1.0, 0),
    'window_larger_than_map_s9_3x4': (1, 3, 4, 4, 2, 9, 1.0, 1.0, 1),
    'one_head': (2, 5, 5, 3, 1, 3, 1.0, 1.0, 2),
    'key_per_channel': (2, 6, 5, 4, 4, 5, 1.0, 1.0, 3),
    'kernel_1_non_square': (2, 3, 9, 4, 2, 1, 1.0, 1.0, 4),
    'tiles_10x9_head_dim_44': (3, 10, 9, 44, 1, 3, 1.0, 1.0, 5),
    'head_dim_16_products': (2, 5, 7, 32, 2, 3, 1.0, 1.0, 6),
    'map_1x1_s3': (2, 1, 1, 2, 1, 3, 1.0, 1.0, 7),
    'key_scale_20_bias_scale_3': (2, 5, 6, 4, 2, 3, 20.0, 3.0, 8),
    'keys_and_biases_1e4': (2, 6, 7, 4, 2, 5, 1e4, 1e4, 9),
    'batch_1': (1, 5, 7, 4, 1, 3, 1.0, 1.0, 10),
    'batch_64': (64, 2, 3, 2, 1, 3, 1.0, 1.0, 11),
    'far_rows_9x4_s3': (2, 9, 4, 4, 2, 3, 3.0, 3.0, 12),
    'far_rows_20x3_s5_1e4': (2, 20, 3, 4, 2, 5, 1e4, 1e4, 14),
    'far_rows_20x3_s3': (1, 20, 3, 2, 1, 3, 1.0, 1.0, 15),
}
# 16-bit inputs: float16 everywhere; bfloat16 where no tl.dot runs (the interpreter's bfloat16 tl.dot is not faithful:
# the products' path is checked in bfloat16 on a GPU, scripts/gpu_check.sh)
HALF_CASES = {torch.float16: ['borders_5x7_s3', 'window_larger_than_map_s9_3x4', 'head_dim_16_products',
                              'keys_and_biases_1e4'],
              torch.bfloat16: ['borders_5x7_s3', 'key_per_channel', 'keys_and_biases_1e4']}


@contextlib.contextmanager
def without_overflow_checks():
    """Triton's interpreter without its int32 overflow checks (where its options have no such field, with them)."""
    from triton.runtime import interpreter
    builder = getattr(interpreter, 'interpreter_builder', None)
    options = getattr(builder, 'options', None)
    if not hasattr(options, 'sanitize_overflow'):
        yield
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    try:
        yield
    finally:
        builder.options = options


def case_inputs(case, device='cpu', dtype=torch.float32):
    """``aft_reference.grid_inputs`` of a case, rounded to ``dtype``, and a float64 upstream gradient rounded alike."""
    q, k, v, w = ref.grid_inputs(*case, dtype=dtype, device=device)
    return q, k, v, w, ref.upstream(q, seed=123).to(device=device, dtype=dtype)


def reference_and_bound(case, dtype):
    """The float64 results on the ``dtype``-rounded inputs and their bounds for sums of positive terms, accumulated in
    float32 with operands in ``dtype``."""
    q, k, v, w, grad_out = case_inputs(case, dtype=dtype)
    problem = ref.conv_problem(q, k, v, w)
    return problem, grad_out, ref.evaluate(problem, grad_out), ref.bound(
        problem, grad_out, 'positive', torch.float32, dtype)


def ratios(case, device='cpu', dtype=torch.float32):
    """Largest error-to-bound ratio of the operator's output and q / k / v / w gradients (inputs in ``dtype``)."""
    _, grad_out, expected, bounds = reference_and_bound(case, dtype)
    inputs = [t.to(device).requires_grad_(True) for t in case_inputs(case, dtype=dtype)[:4]]
    out = torch.ops.aft_vision.aft_conv2d(*inputs)[0]
    grads = torch.autograd.grad(out, inputs, grad_out.to(device))
    results = {name: t.cpu() for name, t in zip(['out', 'dq', 'dk', 'dv', 'dw'], (out,) + grads)}
    return dict(ref.excess(results, expected, bounds), dtype=str(out.dtype), shape=list(out.shape))


def _gradcheck():
    inputs = [t.requires_grad_(True) for t in case_inputs((1, 2, 3, 2, 1, 3, 2.0, 2.0, 13), dtype=torch.float64)[:4]]
    return torch.autograd.gradcheck(lambda *t: torch.ops.aft_vision.aft_conv2d(*t)[0], inputs)


def _wiring(case):
    """``aft_conv2d(..., method='fused')`` against the operator called directly."""
    from aft_vision.layers import functional
    inputs = case_inputs(case)[:4]
    routed = functional.aft_conv2d(*inputs, method='fused')
    return (routed - torch.ops.aft_vision.aft_conv2d(*inputs)[0]).abs().max().item()


def _whole_model():
    """A small registered model on the fused and dense methods in float32, each against the dense method in
    float64: per method, the largest error of the output and of every parameter gradient, relative to that tensor's
    largest float64 entry."""
    import timm
    torch.manual_seed(0)
    kwargs = dict(img_size=32, num_classes=5, patch_size=8, kernel_size=3, depth=2)
    methods = ('fused', 'dense', 'exact')
    models = {method: timm.create_model('aft_conv_test', mixer_kwargs={'method': 'dense' if method == 'exact' else
                                                                       method}, **kwargs) for method in methods}
    for name, param in models['fused'].named_parameters():  # a trained-looking bias (Eq. 8's gamma and beta start 0)
        if 'pos_gamma' in name or 'pos_beta' in name:
            torch.nn.init.normal_(param)
    for method in methods[1:]:
        models[method].load_state_dict(models['fused'].state_dict())
    models['exact'].double()
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    tensors = {}
    for method, model in models.items():
        out = model(images.to(next(model.parameters()).dtype))
        out.square().sum().backward()
        tensors[method] = [out] + [p.grad for p in model.parameters()]
    exact = tensors.pop('exact')
    return {method: max(((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()
                        for got, want in zip(got_all, exact)) for method, got_all in tensors.items()}


def main():
    """Run every case (with TRITON_INTERPRET=1 on a CPU) and print the results as one JSON line."""
    lazy = 'aft_vision.layers.aft_conv_fused' not in sys.modules
    torch.manual_seed(0)
    results = {name: ratios(case) for name, case in CASES.items()}
    with without_overflow_checks():
        for dtype, names in HALF_CASES.items():
            results[str(dtype)] = {name: ratios(CASES[name], dtype=dtype) for name in names}
        results['_gradcheck'] = _gradcheck()
        results['_wiring'] = _wiring(CASES['borders_5x7_s3'])
        results['_model'] = _whole_model()
    results['_lazy_import'] = lazy
    print('RESULTS ' + json.dumps(results))


if __name__ == '__main__':
    main()

"""The fused windowed AFT-conv Triton kernel (``aft_vision/layers/aft_conv_triton.py``) against a float64 reference.

On a CPU-only machine the kernel runs under Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``)
before triton builds the kernels: the cases below therefore run in one subprocess, started by a module fixture,
that executes this file as a script and prints, per case, the largest ratio of each result's error to its rounding
bound as JSON. The reference and the bound are ``aft_reference.py``'s (the float64 definition of Eq. 6, and per entry
``gamma_n`` times the magnitude of the terms summed plus the exp arguments' rounding, for the split form this kernel
evaluates); under the interpreter ``tl.dot`` is a numpy product, so the summation order is OpenBLAS's and changes
with the CPU and ``OPENBLAS_CORETYPE``, which the bound allows for. ``MUTATIONS`` (a key dropped, the global term off
by one position, the window read one offset off) must each fail the same check.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import aft_reference as ref

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
TIMEOUT_S = 300
# On a 1 x 1 map every AFT variant returns sigmoid(q) * v whatever the weights: only a dropped key changes anything.
EQUIVALENT_MUTANTS = {('map_1x1_s3', 'global_term_off_by_one'), ('map_1x1_s3', 'window_offset_shifted')}


def make_inputs(batch, height, width, channels, num_heads, ksize, key_scale, bias_scale, seed, device='cpu',
                dtype=torch.float64):
    """Seeded q, v (B, H, W, C), k (B, H, W, h), w (h, s, s) and an upstream gradient, rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, height, width, channels, generator=gen, dtype=torch.float64)
    k = key_scale * torch.randn(batch, height, width, num_heads, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, height, width, channels, generator=gen, dtype=torch.float64)
    w = bias_scale * torch.randn(num_heads, ksize, ksize, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(123), dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, w, grad_out)]


def _reference_and_bound(case, dtype):
    """The float64 results on the ``dtype``-rounded inputs (the kernel's error, not the inputs' rounding) and their
    bounds for the split form, accumulated in float32 with operands in ``dtype``."""
    q, k, v, w, grad_out = make_inputs(*case, dtype=dtype)
    problem = ref.conv_problem(q, k, v, w)
    return problem, grad_out, ref.evaluate(problem, grad_out), ref.bound(
        problem, grad_out, 'split', torch.float32, dtype)


def _ratios(case, device='cpu', dtype=torch.float32):
    """Largest error-to-bound ratio of the kernel's output and q / k / v / w gradients (inputs in ``dtype``)."""
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    _, grad_out, expected, bounds = _reference_and_bound(case, dtype)
    inputs = [t.to(device).requires_grad_(True) for t in make_inputs(*case, dtype=dtype)[:4]]
    out = aft_conv2d_triton(*inputs)
    grads = torch.autograd.grad(out, inputs, grad_out.to(device))
    results = {name: t.cpu() for name, t in zip(['out', 'dq', 'dk', 'dv', 'dw'], (out,) + grads)}
    return dict(ref.excess(results, expected, bounds), dtype=str(out.dtype), shape=list(out.shape))


def _check(result, label):
    ref.assert_ratios({key: result[key] for key in ['out', 'dq', 'dk', 'dv', 'dw']}, label)


def _finite(case):
    """Whether the kernel's output and gradients are finite for keys and biases of large magnitude."""
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    q, k, v, w, _ = make_inputs(*case)
    w = case[7] * (2.0 * torch.rand(w.shape, generator=torch.Generator().manual_seed(case[8]), dtype=w.dtype) - 1.0)
    tri_in = [t.float().requires_grad_(True) for t in (q, k, v, w)]
    out = aft_conv2d_triton(*tri_in)
    grads = torch.autograd.grad(out.sum(), tri_in)
    return all(bool(torch.isfinite(t).all()) for t in (out,) + grads)


def _wiring(case):
    """``aft_conv2d(..., method='triton')`` against this kernel called directly."""
    from aft_vision.layers import functional
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    inputs = make_inputs(*case, dtype=torch.float32)[:4]
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


def _main():
    """Run every case (call with TRITON_INTERPRET=1 on CPU) and print the results as one JSON line."""
    import aft_vision  # noqa: F401
    lazy = 'aft_vision.layers.aft_conv_triton' not in sys.modules
    torch.manual_seed(0)
    results = {name: _ratios(case) for name, case in CASES.items()}
    # float16 is faithful under the interpreter (bfloat16 tl.dot is not): it covers the half-operand path
    results['_float16'] = {name: _ratios(CASES[name], dtype=torch.float16) for name in HALF_CASES}
    results['_lazy_import'] = lazy
    results['_extreme_finite'] = _finite(EXTREME)
    results['_wiring'] = _wiring(CASES['borders_5x7_s3'])
    results['_model'] = _whole_model()
    print('RESULTS ' + json.dumps(results))


@pytest.fixture(scope='module')
def interpreter_results():
    pytest.importorskip('triton')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=root + os.pathsep + os.environ.get('PYTHONPATH', ''))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
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
    problem, grad_out, expected, bounds = _reference_and_bound(CASES[name], dtype)
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
    _check(_ratios(CUDA_CASES[name], device='cuda', dtype=torch.float32), name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('name', ['borders_5x7_s3', 'window_larger_than_map_s15_4x6', 'small_14x14_s15',
                                  'map_24x24_s11'])
def test_cuda_half_matches_float64_reference(name, dtype):
    if not _cuda_ready():
        pytest.skip('triton is missing or TRITON_INTERPRET=1 is set')
    result = _ratios(CUDA_CASES[name], device='cuda', dtype=dtype)
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


if __name__ == '__main__':
    _main()

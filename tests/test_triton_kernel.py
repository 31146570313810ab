"""The fused windowed AFT-conv Triton kernel (``aft_vision/layers/aft_conv_triton.py``) against a float64 reference.

On a CPU-only machine the kernel runs under Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``)
before triton builds the kernels: the cases below therefore run in one subprocess, started by a module fixture,
that executes this file as a script and prints the maximum errors as JSON. The reference is written here, from
Eq. 6 directly: a dense (h, T, T) bias (``w`` inside each query's s x s window, 0 outside) added to the keys, a
softmax over all key positions, the values averaged and gated by ``sigmoid(q)``, all in float64 autograd.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

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
TOL = 1e-5
HALF_CASES = ['borders_5x7_s3', 'window_larger_than_map_s15_4x6', 'key_scale_20_bias_scale_3']
HALF_TOL = 2e-3  # float16 operands (2^-11), float32 accumulation
TIMEOUT_S = 300


def reference(q, k, v, w):
    """AFT-conv (Eq. 6) from the definition: softmax over all keys of ``k + bias``, bias ``w`` inside the window and
    0 outside, averaging the values, gated by ``sigmoid(q)``. Run it in float64."""
    batch, height, width, channels = q.shape
    num_heads, ksize = w.shape[0], w.shape[-1]
    radius = ksize // 2
    d = channels // num_heads
    num_pos = height * width
    ys, xs = torch.meshgrid(torch.arange(height, device=w.device), torch.arange(width, device=w.device), indexing='ij')
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    dy = ys[None, :] - ys[:, None]  # (T query, T key): key row minus query row
    dx = xs[None, :] - xs[:, None]
    inside = (dy.abs() <= radius) & (dx.abs() <= radius)
    rows = (dy + radius).clamp(0, ksize - 1)
    cols = (dx + radius).clamp(0, ksize - 1)
    bias = torch.where(inside, w[:, rows, cols], torch.zeros((), dtype=w.dtype, device=w.device))  # (h, T, T)
    logits = k.reshape(batch, num_pos, num_heads).permute(0, 2, 1).unsqueeze(2) + bias  # (B, h, T, T)
    weights = torch.softmax(logits, dim=-1)
    values = v.reshape(batch, num_pos, num_heads, d).permute(0, 2, 1, 3)  # (B, h, T, d)
    mixed = (weights @ values).permute(0, 2, 1, 3).reshape(batch, height, width, channels)
    return torch.sigmoid(q) * mixed


def make_inputs(batch, height, width, channels, num_heads, ksize, key_scale, bias_scale, seed, device='cpu'):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, height, width, channels, generator=gen, dtype=torch.float64)
    k = key_scale * torch.randn(batch, height, width, num_heads, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, height, width, channels, generator=gen, dtype=torch.float64)
    w = bias_scale * torch.randn(num_heads, ksize, ksize, generator=gen, dtype=torch.float64)
    return q.to(device), k.to(device), v.to(device), w.to(device)


def _errors(case, device='cpu', dtype=torch.float32):
    """Maximum errors of the kernel's forward and gradients (inputs in ``dtype``), each relative to the largest entry
    of its float64 reference (absolute below 1)."""
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    inputs = make_inputs(*case, device=device)
    grad_gen = torch.Generator().manual_seed(123)
    grad_out = torch.randn(inputs[0].shape, generator=grad_gen, dtype=torch.float64).to(device)
    ref_in = [t.clone().requires_grad_(True) for t in inputs]
    ref = reference(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, grad_out)
    tri_in = [t.to(dtype).requires_grad_(True) for t in inputs]
    out = aft_conv2d_triton(*tri_in)
    grads = torch.autograd.grad(out, tri_in, grad_out.to(dtype))
    result = {'dtype': str(out.dtype), 'shape': list(out.shape)}
    for name, got, want in zip(['out', 'dq', 'dk', 'dv', 'dw'], (out,) + grads, (ref,) + ref_grads):
        scale = max(want.abs().max().item(), 1e-30)
        result[name] = (got.double() - want).abs().max().item() / max(scale, 1.0)
    return result


def _finite(case):
    """Whether the kernel's output and gradients are finite for keys and biases of large magnitude."""
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    q, k, v, w = make_inputs(*case)
    w = case[7] * (2.0 * torch.rand(w.shape, generator=torch.Generator().manual_seed(case[8]), dtype=w.dtype) - 1.0)
    tri_in = [t.float().requires_grad_(True) for t in (q, k, v, w)]
    out = aft_conv2d_triton(*tri_in)
    grads = torch.autograd.grad(out.sum(), tri_in)
    return all(bool(torch.isfinite(t).all()) for t in (out,) + grads)


def _wiring(case):
    """``aft_conv2d(..., method='triton')`` against this kernel called directly."""
    from aft_vision.layers import functional
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    inputs = [t.float() for t in make_inputs(*case)]
    routed = functional.aft_conv2d(*inputs, method='triton')
    return (routed - aft_conv2d_triton(*inputs)).abs().max().item()


def _whole_model():
    """A small registered model with ``mixer_kwargs={'method': 'triton'}`` against the same weights on the dense
    method: largest output and parameter-gradient errors, relative to each tensor's scale."""
    import timm
    torch.manual_seed(0)
    kwargs = dict(img_size=48, num_classes=5, patch_size=8, kernel_size=5)
    models = {method: timm.create_model('aft_conv_test', mixer_kwargs={'method': method}, **kwargs)
              for method in ('triton', 'dense')}
    for model in models.values():  # a trained-looking bias (Eq. 8's gamma and beta start at 0)
        for name, param in model.named_parameters():
            if 'pos_gamma' in name or 'pos_beta' in name:
                torch.nn.init.normal_(param)
    models['dense'].load_state_dict(models['triton'].state_dict())
    images = torch.randn(2, 3, 48, 48)
    errors = {}
    outputs = {}
    for method, model in models.items():
        outputs[method] = model(images)
        outputs[method].square().sum().backward()
    errors['out'] = ((outputs['triton'] - outputs['dense']).abs().max() / outputs['dense'].abs().max()).item()
    grads = {name: p.grad for name, p in models['dense'].named_parameters()}
    errors['grad'] = max(((p.grad - grads[name]).abs().max() / grads[name].abs().max().clamp_min(1e-12)).item()
                         for name, p in models['triton'].named_parameters())
    return errors


def _main():
    """Run every case (call with TRITON_INTERPRET=1 on CPU) and print the results as one JSON line."""
    import aft_vision  # noqa: F401
    lazy = 'aft_vision.layers.aft_conv_triton' not in sys.modules
    torch.manual_seed(0)
    results = {name: _errors(case) for name, case in CASES.items()}
    # float16 is faithful under the interpreter (bfloat16 tl.dot is not): it covers the half-operand path
    results['_float16'] = {name: _errors(CASES[name], dtype=torch.float16) for name in HALF_CASES}
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
    for key in ['out', 'dq', 'dk', 'dv', 'dw']:
        assert result[key] < TOL, f'{name}: {key} error {result[key]:.3g} > {TOL:g} ({result})'


@pytest.mark.parametrize('name', HALF_CASES)
def test_interpreter_float16_matches_float64_reference(interpreter_results, name):
    result = interpreter_results['_float16'][name]
    assert result['dtype'] == 'torch.float16'
    for key in ['out', 'dq', 'dk', 'dv', 'dw']:
        assert result[key] < HALF_TOL, f'{name}: {key} error {result[key]:.3g} > {HALF_TOL:g} ({result})'


def test_import_does_not_load_the_kernel_module(interpreter_results):
    assert interpreter_results['_lazy_import'], 'import aft_vision imported aft_conv_triton (and so triton) eagerly'


def test_extreme_inputs_stay_finite(interpreter_results):
    assert interpreter_results['_extreme_finite']


def test_functional_method_triton_routes_here(interpreter_results):
    assert interpreter_results['_wiring'] == 0.0


def test_whole_model_on_the_triton_method_matches_the_dense_one(interpreter_results):
    errors = interpreter_results['_model']
    assert errors['out'] < TOL and errors['grad'] < 1e-4, errors


def test_clear_error_when_triton_cannot_run(monkeypatch):
    from aft_vision.layers import aft_conv_triton
    monkeypatch.setattr(aft_conv_triton, 'triton_available', lambda: False)
    monkeypatch.setattr(aft_conv_triton, 'triton_unavailable_reason', lambda: 'triton could not be imported (test)')
    inputs = [t.float() for t in make_inputs(*CASES['borders_5x7_s3'])]
    with pytest.raises(RuntimeError, match='triton could not be imported'):
        aft_conv_triton.aft_conv2d_triton(*inputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the CPU-only message: this machine has a CUDA device')
def test_clear_error_on_cpu_without_interpreter(monkeypatch):
    pytest.importorskip('triton')
    from aft_vision.layers import aft_conv_triton
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    assert not aft_conv_triton.triton_available()
    inputs = [t.float() for t in make_inputs(*CASES['borders_5x7_s3'])]
    with pytest.raises(RuntimeError, match='TRITON_INTERPRET=1'):
        aft_conv_triton.aft_conv2d_triton(*inputs)


def test_rejects_bad_inputs():
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    q, k, v, w = [t.float() for t in make_inputs(*CASES['borders_5x7_s3'])]
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
    result = _errors(CUDA_CASES[name], device='cuda', dtype=torch.float32)
    for key in ['out', 'dq', 'dk', 'dv', 'dw']:
        assert result[key] < TOL, f'{name}: {key} error {result[key]:.3g} ({result})'


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('name', ['borders_5x7_s3', 'window_larger_than_map_s15_4x6', 'small_14x14_s15',
                                  'map_24x24_s11'])
def test_cuda_half_matches_float64_reference(name, dtype):
    if not _cuda_ready():
        pytest.skip('triton is missing or TRITON_INTERPRET=1 is set')
    result = _errors(CUDA_CASES[name], device='cuda', dtype=dtype)
    assert result['dtype'] == str(dtype)
    tol = 3e-2 if dtype == torch.bfloat16 else HALF_TOL  # operand rounding (2^-8 / 2^-11), float32 accumulation
    for key in ['out', 'dq', 'dk', 'dv', 'dw']:
        assert result[key] < tol, f'{name}: {key} error {result[key]:.3g} ({result})'


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
def test_cuda_no_host_synchronisation():
    if not _cuda_ready():
        pytest.skip('triton is missing or TRITON_INTERPRET=1 is set')
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    inputs = [t.float().requires_grad_(True) for t in make_inputs(*CUDA_CASES['small_14x14_s15'], device='cuda')]
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

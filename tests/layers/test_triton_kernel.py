"""The fused windowed AFT-conv Triton kernel (``aft_conv_triton.py``) against aft_reference.py's float64 reference.

On a CPU-only machine the kernel runs under Triton's interpreter, which must be switched on (``TRITON_INTERPRET=1``)
before triton builds the kernels: the cases run in one subprocess, started by a module fixture, that executes
``tests/triton_check.py`` and prints, per case, the largest ratio of each result's error to its rounding bound as
JSON (the bound: per entry ``gamma_n`` times the magnitude of the terms summed plus the exp arguments' rounding, for
the split form this kernel evaluates; under the interpreter ``tl.dot`` is a numpy product, whose summation order the
bound allows for). ``MUTATIONS`` (a key dropped, the global term off by one position, the window read one offset
off) must each fail the same check. On CUDA the compiled kernel is held to the same bound.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import aft_reference as ref
from triton_check import CASES, HALF_CASES, case_inputs, ratios, reference_and_bound

TIMEOUT_S = 300
# On a 1 x 1 map every AFT variant returns sigmoid(q) * v whatever the weights: only a dropped key changes anything.
EQUIVALENT_MUTANTS = {('map_1x1_s3', 'global_term_off_by_one'), ('map_1x1_s3', 'window_offset_shifted')}


def _check(result, label):
    ref.assert_ratios({key: result[key] for key in ['out', 'dq', 'dk', 'dv', 'dw']}, label)


@pytest.fixture(scope='module')
def interpreter_results():
    pytest.importorskip('triton')
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(tests)
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=root + os.pathsep + os.environ.get('PYTHONPATH', ''))
    script = os.path.join(tests, 'triton_check.py')
    proc = subprocess.run([sys.executable, script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
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
    problem, grad_out, expected, bounds = reference_and_bound(CASES[name], dtype)
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
    inputs = case_inputs(CASES['borders_5x7_s3'])[:4]
    with pytest.raises(RuntimeError, match='triton could not be imported'):
        aft_conv_triton.aft_conv2d_triton(*inputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the CPU-only message: this machine has a CUDA device')
def test_clear_error_on_cpu_without_interpreter(monkeypatch):
    pytest.importorskip('triton')
    from aft_vision.layers import aft_conv_triton
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    assert not aft_conv_triton.triton_available()
    inputs = case_inputs(CASES['borders_5x7_s3'])[:4]
    with pytest.raises(RuntimeError, match='TRITON_INTERPRET=1'):
        aft_conv_triton.aft_conv2d_triton(*inputs)


def test_rejects_bad_inputs():
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    q, k, v, w = case_inputs(CASES['borders_5x7_s3'])[:4]
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
    _check(ratios(CUDA_CASES[name], device='cuda', dtype=torch.float32), name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('name', ['borders_5x7_s3', 'window_larger_than_map_s15_4x6', 'small_14x14_s15',
                                  'map_24x24_s11'])
def test_cuda_half_matches_float64_reference(name, dtype):
    if not _cuda_ready():
        pytest.skip('triton is missing or TRITON_INTERPRET=1 is set')
    result = ratios(CUDA_CASES[name], device='cuda', dtype=dtype)
    assert result['dtype'] == str(dtype)
    _check(result, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_REASON)
def test_cuda_no_host_synchronisation():
    if not _cuda_ready():
        pytest.skip('triton is missing or TRITON_INTERPRET=1 is set')
    from aft_vision.layers.aft_conv_triton import aft_conv2d_triton
    inputs = [t.requires_grad_(True) for t in case_inputs(CUDA_CASES['small_14x14_s15'], device='cuda')[:4]]
    aft_conv2d_triton(*inputs).sum().backward()  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        out = aft_conv2d_triton(*inputs)
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode('default')

"""The fused AFT-conv operator, ``torch.ops.aft_vision.aft_conv2d`` (``method='fused'``), against aft_reference.py's
float64 reference, under eager, ``torch.compile`` and export.

On a CPU-only machine its Triton kernels run under Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before triton builds them: the cases run in one subprocess per worker, started by a session
fixture, that executes ``tests/fused_check.py`` and prints, per case, the largest ratio of each result's error to its
rounding bound for sums of positive terms. ``MUTATIONS`` (a key dropped, the global term off by one position, the
window read one offset off) must each fail the same check. Without the interpreter the operator's CPU kernel is the
conv form; on CUDA the compiled kernels are held to the same bounds (run by scripts/gpu_check.sh).
"""
import gc
import json
import os
import subprocess
import sys

import pytest
import timm
import torch

import aft_reference as ref
from aft_vision.layers import aft_conv2d, dispatch, exporting
from fused_check import CASES, HALF_CASES, case_inputs, ratios, reference_and_bound

TIMEOUT_S = 400
# On a 1 x 1 map every AFT variant returns sigmoid(q) * v whatever the weights: only a dropped key changes anything.
EQUIVALENT_MUTANTS = {('map_1x1_s3', 'global_term_off_by_one'), ('map_1x1_s3', 'window_offset_shifted')}
GRADS = ['out', 'dq', 'dk', 'dv', 'dw']


def _check(result, label):
    ref.assert_ratios({key: result[key] for key in GRADS}, label)


@pytest.fixture(scope='session')  # once per worker: its tests need not run back to back
def interpreter_results():
    pytest.importorskip('triton')
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(tests)
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=root + os.pathsep + os.environ.get('PYTHONPATH', ''))
    proc = subprocess.run([sys.executable, os.path.join(tests, 'fused_check.py')], env=env, cwd=root,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('RESULTS ')]
    assert proc.returncode == 0 and lines, f'interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}'
    return json.loads(lines[-1][len('RESULTS '):])


@pytest.mark.parametrize('name', list(CASES))
def test_interpreter_matches_float64_reference(interpreter_results, name):
    assert interpreter_results[name]['dtype'] == 'torch.float32'
    _check(interpreter_results[name], name)


@pytest.mark.parametrize('dtype,name', [(dtype, name) for dtype, names in HALF_CASES.items() for name in names])
def test_interpreter_16_bit_matches_float64_reference(interpreter_results, dtype, name):
    result = interpreter_results[str(dtype)][name]
    assert result['dtype'] == str(dtype)
    _check(result, f'{name} {dtype}')


MUST_FAIL = [(name, dtype, mutation) for dtype, names in ((torch.float32, list(CASES)), *HALF_CASES.items())
             for name in names for mutation in ref.MUTATIONS
             if (name, mutation) not in EQUIVALENT_MUTANTS and '1e4' not in name]


@pytest.mark.parametrize('name,dtype,mutation', MUST_FAIL)
def test_the_bound_rejects_a_wrong_kernel(name, dtype, mutation):
    """A kernel with this defect, returning its exact float64 result rounded to ``dtype``, fails ``_check``. (At
    keys and biases of 1e4 one key takes all the weight: a dropped neighbour changes nothing there.)"""
    problem, grad_out, expected, bounds = reference_and_bound(CASES[name], dtype)
    wrong = {key: t.to(dtype) for key, t in ref.evaluate(problem, grad_out, mutation).items()}
    with pytest.raises(AssertionError, match='its rounding bound'):
        _check(ref.excess(wrong, expected, bounds), f'{name} {mutation} (must fail)')


def test_import_does_not_load_the_kernels(interpreter_results):
    assert interpreter_results['_lazy_import'], 'import aft_vision imported aft_conv_fused (and so triton) eagerly'


def test_gradcheck_in_float64(interpreter_results):
    assert interpreter_results['_gradcheck']


def test_functional_method_fused_routes_to_the_operator(interpreter_results):
    assert interpreter_results['_wiring'] == 0.0


def test_whole_model_on_the_fused_kernels_matches_the_dense_method(interpreter_results):
    """Through a whole network the error has no closed-form bound: the float32 dense evaluation of the same weights
    measures this network's conditioning times float32 rounding; the kernels must stay within a small multiple."""
    errors = interpreter_results['_model']
    assert errors['fused'] <= 4 * errors['dense'], errors


@pytest.mark.parametrize('scale', [1.0, 30.0])
def test_cpu_kernel_is_the_conv_form_with_its_gradients(scale):
    """Without Triton's interpreter the operator's CPU kernel is the conv form: the same output bit for bit, and
    gradients (by its plain-autograd form) within the float64 reference's bounds for the repaired split form."""
    q, k, v, w, grad_out = case_inputs((2, 5, 6, 8, 2, 3, scale, scale, 3))
    assert torch.equal(aft_conv2d(q, k, v, w, method='fused'), aft_conv2d(q, k, v, w, method='conv'))
    inputs = [t.requires_grad_(True) for t in (q, k, v, w)]
    out = aft_conv2d(*inputs, method='fused')
    results = dict(zip(GRADS, (out,) + torch.autograd.grad(out, inputs, grad_out)))
    problem = ref.conv_problem(q, k, v, w)
    bounds = ref.bound(problem, grad_out, 'split_repaired')
    ref.assert_ratios(ref.excess(results, ref.evaluate(problem, grad_out), bounds), f'cpu kernel x{scale}')


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from a clean dynamo and leaves nothing compiled behind (a later export in the same worker
    once crashed collecting what earlier compiled graphs left)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    gc.collect()


class GraphRecorder:
    """A ``torch.compile`` backend that keeps the call targets of every graph it is given and runs it through AOT
    autograd (``aot_eager``: the operator's fake forward and backward are traced, the kernels run eagerly)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append([str(node.target) for node in gm.graph.nodes])
        return torch._dynamo.lookup_backend('aot_eager')(gm, example_inputs)


def test_model_compiles_to_one_graph_holding_the_operator():
    """``torch.compile(fullgraph=True, dynamic=True)`` of a model on the fused method: one graph for every batch size
    (no recompilation), the operator one node in it per block, and the compiled model's output and gradients those of
    eager. Two blocks (of the test model's four: tracing time grows with depth) show one node per block."""
    torch.manual_seed(0)
    model = timm.create_model('aft_conv_test', num_classes=5, depth=2, mixer_kwargs={'method': 'fused'})
    recorder = GraphRecorder()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=recorder)
    compiled_graphs = []
    for batch in (2, 3, 5):
        images = torch.randn(batch, 3, 32, 32)
        model.zero_grad()
        out = compiled(images)
        out.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        eager = model(images)
        eager.square().sum().backward()
        assert torch.equal(out, eager)
        assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
        compiled_graphs.append(len(recorder.graphs))
    assert compiled_graphs[0] >= 1 and len(set(compiled_graphs)) == 1, f'graphs after each batch: {compiled_graphs}'
    depth = sum('aft_vision.aft_conv2d' in target for target in recorder.graphs[0])
    assert depth == len(model.blocks), recorder.graphs[0]


def test_compiling_is_not_exporting_on_a_torch_whose_flag_says_so(monkeypatch):
    """torch 2.7-2.13 answer ``torch.compiler.is_exporting()`` True under plain ``torch.compile``: on such a torch
    only ONNX export and jit tracing count as exporting, so a compiled model keeps the fused operator."""
    monkeypatch.setattr(dispatch, '_EXPORT_FLAG_TRUSTED', False)
    with monkeypatch.context() as patched:  # what such a torch answers inside a compiled region
        patched.setattr(torch.compiler, 'is_exporting', lambda: True)
        assert not exporting()
    recorder = GraphRecorder()
    q, k, v, w = case_inputs(CASES['borders_5x7_s3'])[:4]
    torch.compile(lambda *t: aft_conv2d(*t, method='fused'), fullgraph=True, backend=recorder)(q, k, v, w)
    assert any('aft_vision.aft_conv2d' in target for target in recorder.graphs[0]), recorder.graphs


def test_torch_export_records_the_convolution_not_the_operator():
    q, k, v, w = case_inputs(CASES['borders_5x7_s3'])[:4]

    class Mixer(torch.nn.Module):
        def forward(self, q, k, v, w):
            return aft_conv2d(q, k, v, w, method='fused')

    program = torch.export.export(Mixer(), (q, k, v, w))
    targets = {str(node.target) for node in program.graph.nodes}
    assert not any('aft_vision' in target for target in targets) and 'aten.conv2d.default' in targets, targets
    torch.testing.assert_close(program.module()(q, k, v, w), aft_conv2d(q, k, v, w, method='conv'))


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter does not type-check like the compiler: build the kernels to cubin for an H100 (sm_90), for
    float32, bfloat16 and float16 inputs, with and without tensor-core products."""
    pytest.importorskip('triton')
    if os.environ.get('TRITON_INTERPRET', '0') == '1':
        pytest.skip('TRITON_INTERPRET=1: triton.jit returns interpreted functions')
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f'this triton has no ASTSource / GPUTarget: {exc}')
    from aft_vision.layers import aft_conv_fused as fused

    def build(fn, types, constexprs):
        names = list(fn.arg_names)
        signature = dict(zip(names, types), **{name: 'constexpr' for name in constexprs})
        src = ASTSource(fn=fn, signature=signature,
                        constexprs={(names.index(name),): value for name, value in constexprs.items()})
        return triton.compile(src, target=GPUTarget('cuda', 90, 32))

    for dtype, name, head_dim in [('fp32', torch.float32, 1), ('bf16', torch.bfloat16, 32), ('fp16', torch.float16, 4)]:
        layout = fused._layout(head_dim * 4, 4, name, torch.float32)
        kernels = [
            build(fused.forward_kernel, [f'*{dtype}'] * 3 + ['*fp32', f'*{dtype}', '*fp32'] + ['i32'] * 6,
                  dict(S=15, BM=fused.BLOCK_M, BK=fused.BLOCK_K, **layout)),
            build(fused.key_grad_kernel, [f'*{dtype}'] * 2 + ['*fp32'] * 4 + [f'*{dtype}'] * 2 + ['i32'] * 5,
                  dict(S=15, BM=fused.BLOCK_M, BN=fused.BLOCK_K, **layout)),
            build(fused.bias_grad_kernel, [f'*{dtype}'] * 2 + ['*fp32'] * 5 + ['i32'] * 6,
                  dict(S=15, BM=fused.BLOCK_M, D=layout['D'], BD=layout['BD'], ACC=layout['ACC'])),
        ]
        assert all('cubin' in kernel.asm for kernel in kernels)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device (scripts/gpu_check.sh runs it)')
CUDA_CASES = dict(CASES, small_14x14_s15=(4, 14, 14, 32, 8, 15, 1.0, 1.0, 20),
                  key_per_channel_14x14_s15=(2, 14, 14, 48, 48, 15, 1.0, 1.0, 21),
                  map_24x24_s11=(2, 24, 24, 48, 3, 11, 2.0, 1.0, 22), kernel_31_3x5=(1, 3, 5, 2, 1, 31, 1.0, 1.0, 23))


@CUDA
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('name', list(CUDA_CASES))
def test_cuda_matches_float64_reference(name, dtype):
    result = ratios(CUDA_CASES[name], device='cuda', dtype=dtype)
    assert result['dtype'] == str(dtype)
    _check(result, f'{name} {dtype}')


@CUDA
def test_cuda_graph_replays_without_host_synchronisation():
    inputs = [t.requires_grad_(True) for t in case_inputs(CUDA_CASES['small_14x14_s15'], device='cuda')[:4]]
    out = torch.ops.aft_vision.aft_conv2d(*inputs)[0]
    torch.autograd.grad(out.sum(), inputs)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        graph, static = torch.cuda.CUDAGraph(), [t.detach().clone() for t in inputs]
        with torch.cuda.graph(graph):
            captured = torch.ops.aft_vision.aft_conv2d(*static)[0]
        graph.replay()
        torch.testing.assert_close(captured, out.detach(), rtol=0, atol=0)
    finally:
        torch.cuda.set_sync_debug_mode('default')


@CUDA
def test_cuda_model_compiles_with_the_operator_under_autocast():
    model = timm.create_model('aft_conv_test', num_classes=5, mixer_kwargs={'method': 'fused'}).cuda()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for batch in (2, 3):
        images = torch.randn(batch, 3, 32, 32, device='cuda')
        with torch.autocast('cuda', dtype=torch.bfloat16):
            out = compiled(images)
            eager = model(images)
        out.float().square().mean().backward()
        torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())

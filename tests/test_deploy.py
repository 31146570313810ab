"""Deployment (``aft_vision.deploy``): every export path in the real toolchains. ONNX by both exporters and timm's
onnx_export, in onnxruntime; TorchScript; torch.export: each against the float64 model (``deploy_cases``), a wrong
graph rejected, the exported operators on hostile inputs. OpenVINO, INT8 and ``aft-vision export``:
``test_deploy_runtimes.py``.
"""

import functools
import gc
from typing import List

import pytest
import torch

import aft_reference as ref
import aft_vision  # noqa: F401  registers the models
from aft_reference import CAUSAL, inputs
from aft_vision.layers import aft_conv2d, aft_full, aft_local, aft_simple
from aft_vision.models.aft_conv import AFTConvTransformer
from deploy_cases import (FULL_CASES, ONNX_EXPORTERS, TEST_CASES, TWO_BLOCK_CASES, assert_agrees, build_case,
                          export_sizes, quiet, random_images)

# the deployment toolchains (the test extra): without them this part is skipped
onnx = pytest.importorskip('onnx')
ort = pytest.importorskip('onnxruntime')
pytest.importorskip('onnxscript')  # the dynamo exporter's back end
ov = pytest.importorskip('openvino')
pytest.importorskip('nncf')

# ---------------------------------------------------------------------------------------------------------------------
# Every export path gives the model's own numbers: ONNX by both of torch's exporters and by timm's ``onnx_export``, run
# in onnxruntime; TorchScript (``torch.jit.trace`` and ``torch.jit.script``) and ``torch.export``, each saved, loaded
# and run.
#
# Every graph runs on fresh inputs that differ from its export example (another batch size, and for AFT-conv another
# height and width) and is held to ``aft_reference.assert_model_agrees``: within ``8 |eager - exact| + 8 u |exact|`` of
# the same model in float64, a bound from float32 rounding and the case's own conditioning, never a fitted tolerance.
# ``test_the_bound_rejects_a_wrong_graph`` shows that a graph with one operator changed fails it. The models run in two
# weight states: as built (every layer's Eq. 8 gamma and beta are zeros, which the TorchScript exporter deduplicates
# into Identity nodes) and with random position biases (so that a wrong window or bias changes the result).
#
# An exported graph cannot repair on the host: it keeps the 'cuda' policy's guarantee (docs/deployment.md), which the
# operator tests at the end check on hostile inputs against the float64 reference.
# ---------------------------------------------------------------------------------------------------------------------


def export_onnx(model, exporter: str, example: torch.Tensor, path) -> List[str]:
    """Export ``model`` with ``exporter`` (``ONNX_EXPORTERS``), a dynamic batch axis and, for AFT-conv, a dynamic
    height and width; returns the written paths: for 'dynamo' the graph as exported and, from the same export,
    after onnxscript's optimiser (``ONNXProgram.optimize``, what ``optimize=True`` runs), two files."""
    from timm.utils.onnx import onnx_export
    is_conv = isinstance(model, AFTConvTransformer)
    path = str(path)
    # what earlier tests in this worker left is never collected: torch 2.14 segfaulted collecting it (mid-trace, and
    # inside an explicit gc.collect() here)
    gc.freeze()
    with quiet():
        if exporter.startswith('torchscript'):
            axes = {0: 'batch', **({2: 'height', 3: 'width'} if is_conv else {})}
            torch.onnx.export(model, (example,), path, dynamo=False, opset_version=int(exporter[-2:]),
                              input_names=['x'], output_names=['logits'],
                              dynamic_axes={'x': axes, 'logits': {0: 'batch'}})
        elif exporter == 'dynamo':  # ``model``: the module's torch.export program (``exported_program``)
            program = torch.onnx.export(model, (), path, dynamo=True, optimize=False)
            program.optimize()  # one export, both forms: the optimiser rewrites the exported graph in place
            optimized = path.replace('.onnx', '_optimized.onnx')
            program.save(optimized)
            return [path, optimized]
        else:  # timm's own, with its onnxruntime check of the export example
            onnx_export(model, path, example_input=example, check_forward=True, dynamic_size=is_conv,
                        use_dynamo=exporter == 'timm_dynamo')
    return [path]


def run_onnx(path: str, *arrays: torch.Tensor, names=None) -> torch.Tensor:
    """The graph's first output in onnxruntime's CPU provider with its default (full) graph optimisations.
    ``names``: the tensors' input names, for graphs that drop unused inputs."""
    session = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    if names is None:
        names = [i.name for i in session.get_inputs()]
    wanted = {i.name for i in session.get_inputs()}
    feed = {name: a.numpy() for name, a in zip(names, arrays) if name in wanted}
    return torch.from_numpy(session.run(None, feed)[0])


@functools.lru_cache(maxsize=None)
def exported_program(case: str, state: str = 'trained') -> torch.export.ExportedProgram:
    """``torch.export.export`` of the case's model with a dynamic batch and, for AFT-conv, any multiple of the patch
    size as height and width: the call ``torch.onnx.export(model, dynamo=True, dynamic_shapes=...)`` makes first (its
    own strategy, ``strict=False``), made once per model for the dynamo exporter and the torch.export round trip."""
    from torch.export import Dim
    model = build_case(case, state)
    dims = {0: Dim('batch', min=1, max=64)}
    if isinstance(model, AFTConvTransformer):
        patch = model.patch_embed.patch_size[0]
        dims.update({2: patch * Dim('grid_h', min=1, max=64), 3: patch * Dim('grid_w', min=1, max=64)})
    gc.freeze()  # as in export_onnx
    with quiet():
        return torch.export.export(model, (random_images(*export_sizes(model)[0], 0),), dynamic_shapes={'x': dims})


def check_onnx(case, state, exporter, tmp_path):
    model = build_case(case, state)
    example_size, fresh = export_sizes(model)
    source = exported_program(case, state) if exporter == 'dynamo' else model
    for path in export_onnx(source, exporter, random_images(*example_size, 0), tmp_path / f'{case}.onnx'):
        for seed, size in enumerate(fresh, start=1):
            got = run_onnx(path, random_images(*size, seed))
            assert_agrees(case, state, got, size, seed, f'{case} {state} {exporter} {size} ({path})')


def check_torchscript(case, method, tmp_path):
    model = build_case(case, 'trained')
    example_size, fresh = export_sizes(model)
    path = tmp_path / f'{case}.pt'
    with quiet():  # torch.jit.save and load warn that TorchScript is deprecated
        example = random_images(*example_size, 0)
        graph = torch.jit.trace(model, example) if method == 'trace' else torch.jit.script(model)
        torch.jit.save(graph, str(path))
        loaded = torch.jit.load(str(path))
    for seed, size in enumerate(fresh, start=1):
        with torch.no_grad():
            got = loaded(random_images(*size, seed))
        assert_agrees(case, 'trained', got, size, seed, f'{case} jit.{method} {size}')


def check_torch_export(case, tmp_path):
    fresh = export_sizes(build_case(case, 'trained'))[1]
    program = exported_program(case)
    path = tmp_path / f'{case}.pt2'
    torch.export.save(program, str(path))
    loaded = torch.export.load(str(path)).module()
    for seed, size in enumerate(fresh, start=1):
        with torch.no_grad():
            got = loaded(random_images(*size, seed))
        assert_agrees(case, 'trained', got, size, seed, f'{case} torch.export {size}')


# ---------------------------------------------------------------------------------------------------------------------
# The test models (fast suite) and one full-size model per family (slow)

def _sharing_a_program(case):
    """The case, its tests run by one pytest-xdist worker (``--dist loadgroup``): they read one ``exported_program``."""
    return pytest.param(case, marks=pytest.mark.xdist_group(f'exported_program_{case}'))


@pytest.mark.parametrize('exporter', [exporter for exporter in ONNX_EXPORTERS if 'dynamo' not in exporter])
@pytest.mark.parametrize('case', list(TEST_CASES))
def test_onnx_matches_eager(case, exporter, tmp_path):
    check_onnx(case, 'trained', exporter, tmp_path)


@pytest.mark.parametrize('case', [_sharing_a_program(case) for case in TWO_BLOCK_CASES])
def test_dynamo_onnx_matches_eager(case, tmp_path):
    """The dynamo exporter's graph as exported and optimised (``TWO_BLOCK_CASES``). timm's dynamo call differs only in
    its automatic dynamic axes: it runs at full size (one export of 10-40 s per test model saved here)."""
    check_onnx(case, 'trained', 'dynamo', tmp_path)


@pytest.mark.parametrize('case', list(TEST_CASES))
def test_onnx_matches_eager_as_built(case, tmp_path):
    """As built, equal parameters (zeros) in every layer: the TorchScript exporter shares them through Identity
    nodes, which onnxruntime's graph optimiser once lost (AFT-conv's Eq. 8 scale, ``AFTConv2d.position_bias``)."""
    check_onnx(case, 'built', 'torchscript_opset17', tmp_path)


@pytest.mark.parametrize('method', ('trace', 'script'))
@pytest.mark.parametrize('case', list(TEST_CASES))
def test_torchscript_round_trip(case, method, tmp_path):
    check_torchscript(case, method, tmp_path)


@pytest.mark.parametrize('case', [_sharing_a_program(case) for case in TWO_BLOCK_CASES])
def test_torch_export_round_trip(case, tmp_path):
    check_torch_export(case, tmp_path)


FULL_DYNAMO_CASES = [case for case in FULL_CASES if not case.endswith('_onehot')]


@pytest.mark.slow
@pytest.mark.parametrize('case,exporter', [(case, exporter) for case in FULL_CASES for exporter in ONNX_EXPORTERS
                                           if exporter.startswith(('torchscript', 'timm'))
                                           and (exporter != 'timm_dynamo' or case in FULL_DYNAMO_CASES)])
def test_full_size_onnx_matches_eager(case, exporter, tmp_path):
    """The real widths, heads, kernels and input size (``FULL_CASES``: 2 blocks). The dynamo exporter through timm's
    ``onnx_export`` (the plain call is the same exporter)."""
    check_onnx(case, 'trained', exporter, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize('case', FULL_DYNAMO_CASES)
def test_full_size_torchscript_and_torch_export(case, tmp_path):
    check_torchscript(case, 'trace', tmp_path)
    check_torch_export(case, tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# The comparison catches a wrong graph

def _shift_window(graph):
    """The first depthwise convolution (AFT-conv's window sums) reads every key one column to the right."""
    for node in graph.node:
        groups = [a.i for a in node.attribute if a.name == 'group']
        if node.op_type == 'Conv' and groups and groups[0] > 1:
            pads = next(a for a in node.attribute if a.name == 'pads')
            pads.ints[1] -= 1  # [top, left, bottom, right]: the same output size, the window one offset over
            pads.ints[3] += 1
            return
    raise AssertionError('no depthwise Conv in the graph')


def _hard_gate(graph):
    """The first gate ``sigmoid(q)`` becomes onnx's HardSigmoid (0.2 q + 0.5, clipped): off by up to 0.07."""
    node = next(n for n in graph.node if n.op_type == 'Sigmoid')
    node.op_type = 'HardSigmoid'


GRAPH_MUTATIONS = {
    ('aft_conv_test', 'window_shifted'): _shift_window,
    ('aft_conv_test', 'gate_changed'): _hard_gate,
    ('aft_full_test', 'gate_changed'): _hard_gate,
    ('aft_simple_test', 'gate_changed'): _hard_gate,
}


@pytest.mark.parametrize('case,mutation', list(GRAPH_MUTATIONS))
def test_the_bound_rejects_a_wrong_graph(case, mutation, tmp_path):
    model = build_case(case, 'trained')
    example_size, fresh = export_sizes(model)
    (path,) = export_onnx(model, 'torchscript_opset18', random_images(*example_size, 0), tmp_path / 'model.onnx')
    graph = onnx.load(path)
    GRAPH_MUTATIONS[case, mutation](graph.graph)
    onnx.save(graph, path)
    got = run_onnx(path, random_images(*fresh[-1], 1))
    with pytest.raises(AssertionError, match='its rounding bound'):
        assert_agrees(case, 'trained', got, fresh[-1], 1, f'{case} {mutation} (must fail)')


# ---------------------------------------------------------------------------------------------------------------------
# What an exported graph promises: the 'cuda' policy's guarantee, on inputs far from the export example

class _Operator(torch.nn.Module):
    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, q, k, v, w):
        if self.op == 'full':
            return aft_full(q, k, v, w)
        if self.op == 'causal':
            return aft_full(q, k, v, w, causal=True)
        if self.op == 'local':
            return aft_local(q, k, v, w, 3)
        if self.op == 'simple':
            return aft_simple(q, k, v)
        if self.op == 'simple_causal':
            return aft_simple(q, k, v, causal=True)
        return aft_conv2d(q, k, v, w, method=self.op)  # 'dense' or 'conv'


def _export_operator(op, exporter, path):
    names = ['q', 'k', 'v', 'w']
    with quiet():
        torch.onnx.export(_Operator(op), inputs(op, 1.0, 1.0, seed=0), str(path), dynamo=exporter == 'dynamo',
                          input_names=names, **({} if exporter == 'dynamo' else {'opset_version': 18}))
    return str(path)


@pytest.mark.parametrize('exporter', ('torchscript', 'dynamo'))
@pytest.mark.parametrize('op', ref.OPS)
def test_exported_operator_keeps_the_cuda_policy_bound(op, exporter, tmp_path):
    """A graph exported from ordinary inputs, run on keys up to scale 20 and biases up to scale 3 (causal prefixes
    within the 'cuda' policy's limit), is exact to rounding; on keys and biases of 1e4 it stays finite."""
    path = _export_operator(op, exporter, tmp_path / f'{op}.onnx')
    names = ['q', 'k', 'v', 'w']
    key_scale = 5.0 if op in CAUSAL else 20.0
    q, k, v, w = inputs(op, key_scale, 3.0, seed=2)
    out = run_onnx(path, q, k, v, w, names=names)
    problem = ref.problem_for(op, q, k, v, w)
    ref.assert_output(out, problem, ref.terms_for(op, 'cuda'), label=f'{op} {exporter} hostile')
    extreme = inputs(op, 1e4, 1e4, seed=3)
    assert torch.isfinite(run_onnx(path, *extreme, names=names)).all(), f'{op} {exporter}: not finite'

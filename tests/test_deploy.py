"""Deployment (``aft_vision.deploy``, ``aft-vision export``): every export path and the CPU runtimes, in the real
toolchains.

* Every export path (ONNX by both exporters and timm's onnx_export, in onnxruntime; TorchScript; torch.export) against
  the float64 model, a wrong graph rejected, the exported operators on hostile inputs.
* OpenVINO IRs of the test models against the same bound, the converted graph's layout, the INT8 recipes' scope in
  NNCF's and onnxruntime's graphs, ``aft-vision export`` (writes, checks, refuses), bench in both runtimes.
"""
import contextlib
import copy
import functools
import io
import json
import warnings

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import aft_reference as ref
import aft_vision  # noqa: F401  registers the models
from aft_reference import CAUSAL, inputs
from aft_vision import deploy
from aft_vision.cli import main as cli_main
from aft_vision.layers import aft_conv2d, aft_full, aft_local, aft_simple
from aft_vision.models.aft_conv import AFTConvTransformer, export_layout

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


# case -> (architecture, model kwargs): every registered test model, and AFT-conv with Sec. 8's one-hot mixer
TEST_CASES = {
    'aft_conv_test': ('aft_conv_test', {}),
    'aft_conv_test_onehot': ('aft_conv_test', {'mixer_layer': 'aft_conv_onehot'}),
    # built for 1.5x its 64 px with its windows resampled (resize_mode='window'): 5 x 5 -> 7 x 7
    'aft_conv_test_window': ('aft_conv_test', {'img_size': 96, 'base_img_size': 64}),
    'aft_full_test': ('aft_full_test', {}),
    'aft_simple_test': ('aft_simple_test', {}),
}
# one full-size model per family, under the slow mark (the one-hot mixer at full size through the TorchScript-based
# exporters only: its dynamo, torch.export and jit paths run on the test model, and the full command must stay short)
FULL_CASES = {
    'aft_conv_tiny': ('aft_conv_tiny', {}),
    'aft_conv_tiny_onehot': ('aft_conv_tiny', {'mixer_layer': 'aft_conv_onehot'}),
    'aft_full_tiny': ('aft_full_tiny', {}),
    'aft_simple_tiny': ('aft_simple_tiny', {}),
}
ONNX_EXPORTERS = ('torchscript_opset17', 'torchscript_opset18', 'dynamo', 'timm', 'timm_dynamo')
STATES = ('built', 'trained')


@functools.lru_cache(maxsize=None)
def _build(case: str, state: str) -> torch.nn.Module:
    """The case's model in eval mode; ``'trained'`` draws every position-bias parameter (AFT-conv's Eq. 8 raw bias,
    gamma and beta; AFT-full's factors), so that every window offset and bias entry matters."""
    arch, kwargs = {**TEST_CASES, **FULL_CASES, **OPENVINO_CASES}[case]
    torch.manual_seed(0)
    model = timm.create_model(arch, **kwargs).eval()
    if state == 'trained':
        with torch.no_grad():
            for name, param in model.named_parameters():
                if '.attn.pos_' in name:
                    param.normal_(0.0, 1.0)
    return model


def _sizes(model):
    """The export example's (B, H, W) and the fresh inputs' (another batch: 3 for the test models, 1 for the full-size
    ones; another height and width for AFT-conv, whose graph takes any multiple of the patch size; AFT-full's at its
    fixed size)."""
    height, width = model.pretrained_cfg['input_size'][-2:]
    patch = model.patch_embed.patch_size[0]
    fresh = [(3 if height <= 64 else 1, height, width)]
    if isinstance(model, AFTConvTransformer):
        fresh.append((1, height + 2 * patch, width - patch))
    return (2, height, width), fresh


@functools.lru_cache(maxsize=None)
def _images(batch, height, width, seed):
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def _references(case: str, state: str, size, seed: int):
    """The eager float32 and float64 outputs for ``_images(*size, seed)``, shared by the case's exporters."""
    model, x = _build(case, state), _images(*size, seed)
    with torch.no_grad():
        return model(x), copy.deepcopy(model).double()(x.double())


def assert_agrees(case, state, got: torch.Tensor, size, seed: int, label: str):
    """``got`` (the graph's output for ``_images(*size, seed)``) within the float32 rounding bound of the float64
    model."""
    eager, exact = _references(case, state, size, seed)
    assert got.shape == eager.shape, f'{label}: shape {list(got.shape)}, eager {list(eager.shape)}'
    ref.assert_model_agrees(got, exact, eager, label=label)


@contextlib.contextmanager
def _quiet():
    """The exporters' warnings and progress lines (TracerWarnings on shape arithmetic, onnxscript's report)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter('ignore')
        yield


def export_onnx(model, exporter: str, example: torch.Tensor, path) -> str:
    """Export ``model`` with ``exporter`` (``ONNX_EXPORTERS``), a dynamic batch axis and, for AFT-conv, a dynamic
    height and width; returns the path."""
    from timm.utils.onnx import onnx_export
    from torch.export import Dim
    is_conv = isinstance(model, AFTConvTransformer)
    path = str(path)
    with _quiet():
        if exporter.startswith('torchscript'):
            axes = {0: 'batch', **({2: 'height', 3: 'width'} if is_conv else {})}
            torch.onnx.export(model, (example,), path, dynamo=False, opset_version=int(exporter[-2:]),
                              input_names=['x'], output_names=['logits'],
                              dynamic_axes={'x': axes, 'logits': {0: 'batch'}})
        elif exporter == 'dynamo':
            patch = model.patch_embed.patch_size[0]
            dims = {0: Dim('batch', min=1, max=64)}
            if is_conv:  # any multiple of the patch size
                dims.update({2: patch * Dim('grid_h', min=1, max=64), 3: patch * Dim('grid_w', min=1, max=64)})
            # without onnxscript's graph optimiser: timm's path ('timm_dynamo') runs it, so both forms are tested
            torch.onnx.export(model, (example,), path, dynamo=True, dynamic_shapes={'x': dims}, optimize=False)
        else:  # timm's own, with its onnxruntime check of the export example
            onnx_export(model, path, example_input=example, check_forward=True, dynamic_size=is_conv,
                        use_dynamo=exporter == 'timm_dynamo')
    return path


def run_onnx(path: str, *arrays: torch.Tensor, names=None) -> torch.Tensor:
    """The graph's first output in onnxruntime's CPU provider with its default (full) graph optimisations.
    ``names``: the tensors' input names, for graphs that drop unused inputs."""
    session = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    if names is None:
        names = [i.name for i in session.get_inputs()]
    wanted = {i.name for i in session.get_inputs()}
    feed = {name: a.numpy() for name, a in zip(names, arrays) if name in wanted}
    return torch.from_numpy(session.run(None, feed)[0])


def check_onnx(case, state, exporter, tmp_path):
    model = _build(case, state)
    example_size, fresh = _sizes(model)
    path = export_onnx(model, exporter, _images(*example_size, 0), tmp_path / f'{case}.onnx')
    for seed, size in enumerate(fresh, start=1):
        got = run_onnx(path, _images(*size, seed))
        assert_agrees(case, state, got, size, seed, f'{case} {state} {exporter} {size}')


def check_torchscript(case, method, tmp_path):
    model = _build(case, 'trained')
    example_size, fresh = _sizes(model)
    path = tmp_path / f'{case}.pt'
    with _quiet():  # torch.jit.save and load warn that TorchScript is deprecated
        graph = torch.jit.trace(model, _images(*example_size, 0)) if method == 'trace' else torch.jit.script(model)
        torch.jit.save(graph, str(path))
        loaded = torch.jit.load(str(path))
    for seed, size in enumerate(fresh, start=1):
        with torch.no_grad():
            got = loaded(_images(*size, seed))
        assert_agrees(case, 'trained', got, size, seed, f'{case} jit.{method} {size}')


def check_torch_export(case, tmp_path):
    from torch.export import Dim
    model = _build(case, 'trained')
    example_size, fresh = _sizes(model)
    dims = {0: Dim('batch', min=1, max=64)}
    if isinstance(model, AFTConvTransformer):
        patch = model.patch_embed.patch_size[0]
        dims.update({2: patch * Dim('grid_h', min=1, max=64), 3: patch * Dim('grid_w', min=1, max=64)})
    with _quiet():
        program = torch.export.export(model, (_images(*example_size, 0),), dynamic_shapes={'x': dims})
    path = tmp_path / f'{case}.pt2'
    torch.export.save(program, str(path))
    loaded = torch.export.load(str(path)).module()
    for seed, size in enumerate(fresh, start=1):
        with torch.no_grad():
            got = loaded(_images(*size, seed))
        assert_agrees(case, 'trained', got, size, seed, f'{case} torch.export {size}')


# ---------------------------------------------------------------------------------------------------------------------
# The test models (fast suite) and one full-size model per family (slow)

@pytest.mark.parametrize('exporter', ONNX_EXPORTERS)
@pytest.mark.parametrize('case', list(TEST_CASES))
def test_onnx_matches_eager(case, exporter, tmp_path):
    check_onnx(case, 'trained', exporter, tmp_path)


@pytest.mark.parametrize('case', list(TEST_CASES))
def test_onnx_matches_eager_as_built(case, tmp_path):
    """As built, equal parameters (zeros) in every layer: the TorchScript exporter shares them through Identity
    nodes, which onnxruntime's graph optimiser once lost (AFT-conv's Eq. 8 scale, ``AFTConv2d.dense_bias``)."""
    check_onnx(case, 'built', 'torchscript_opset17', tmp_path)


@pytest.mark.parametrize('method', ('trace', 'script'))
@pytest.mark.parametrize('case', list(TEST_CASES))
def test_torchscript_round_trip(case, method, tmp_path):
    check_torchscript(case, method, tmp_path)


@pytest.mark.parametrize('case', list(TEST_CASES))
def test_torch_export_round_trip(case, tmp_path):
    check_torch_export(case, tmp_path)


FULL_DYNAMO_CASES = [case for case in FULL_CASES if not case.endswith('_onehot')]


@pytest.mark.slow
@pytest.mark.parametrize('case,exporter', [(case, exporter) for case in FULL_CASES for exporter in ONNX_EXPORTERS
                                           if exporter.startswith(('torchscript', 'timm'))
                                           and (exporter != 'timm_dynamo' or case in FULL_DYNAMO_CASES)])
def test_full_size_onnx_matches_eager(case, exporter, tmp_path):
    """The dynamo exporter through timm's ``onnx_export`` (the plain call is the same exporter)."""
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
    model = _build(case, 'trained')
    example_size, fresh = _sizes(model)
    path = export_onnx(model, 'torchscript_opset18', _images(*example_size, 0), tmp_path / 'model.onnx')
    graph = onnx.load(path)
    GRAPH_MUTATIONS[case, mutation](graph.graph)
    onnx.save(graph, path)
    got = run_onnx(path, _images(*fresh[-1], 1))
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
    with _quiet():
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


# ---------------------------------------------------------------------------------------------------------------------
# CPU deployment (``aft_vision.deploy``, ``aft-vision export``): OpenVINO and INT8 in the real toolchains.
#
# OpenVINO runs every test model converted the way users convert (``openvino.convert_model(model, example_input=x)``),
# saved as an IR, read back and held to the export tests' float32 rounding bound against the float64 model on fresh
# inputs. The converted AFT-conv graphs are checked for the layout their speed depends on: channel-first as
# ``convert_openvino`` records it (no transpose, split or reorder of a map), token rows as a plain conversion does
# (element-wise nodes with the channels innermost, no concatenation or split of the window sums). The INT8 recipes
# are checked for their scope in the quantized graphs NNCF and onnxruntime write (linear layers quantized, window
# convolutions in float), and ``aft-vision export`` for what it writes, prints and refuses.
# ---------------------------------------------------------------------------------------------------------------------


ELEMENT_WISE = ('Add', 'Multiply', 'Divide', 'Subtract', 'Maximum', 'Sigmoid', 'Exp')


# OpenVINO also runs AFT-conv's dense method (its channel-first graph takes the convolution) and one key per channel
OPENVINO_CASES = {
    'aft_conv_test_dense': ('aft_conv_test', {'mixer_kwargs': {'method': 'dense'}}),
    'aft_conv_test_heads': ('aft_conv_test', {'num_heads': 64}),
}


@pytest.mark.parametrize('case', list(TEST_CASES) + list(OPENVINO_CASES))
def test_openvino_ir_matches_eager(case, tmp_path):
    model = _build(case, 'trained')
    example_size, fresh = _sizes(model)
    with _quiet():
        converted = deploy.convert_openvino(model, _images(*example_size, 0))
    ov.save_model(converted, str(tmp_path / 'model.xml'), compress_to_fp16=False)
    run = deploy.load_runner(tmp_path / 'model.xml', 'fp32')
    for seed, size in enumerate(fresh, start=1):
        got = torch.from_numpy(run(_images(*size, seed).numpy()))
        assert_agrees(case, 'trained', got, size, seed, f'{case} in OpenVINO at {size}')


def test_export_layout_leaves_eager_untouched_and_is_restored():
    """``export_layout`` changes only what a tracer records: eager logits bit for bit, the layout restored on leaving
    (an error included) in every AFT-conv model of a wrapper; an unknown layout is refused by name."""
    model = _build('aft_conv_test', 'trained')
    features = timm.create_model('aft_conv_test', features_only=True, out_indices=(1, 3)).eval()
    x = _images(2, 64, 64, 1)
    with torch.no_grad():
        before = model(x)
        with export_layout(model, 'NCHW'):
            assert model.export_layout == 'NCHW'
            assert torch.equal(model(x), before)
        with pytest.raises(RuntimeError, match='inside'), export_layout(features, 'NCHW'):
            assert [m.export_layout for m in features.modules() if isinstance(m, AFTConvTransformer)] == ['NCHW']
            raise RuntimeError('inside')
    assert model.export_layout == 'NHWC'
    assert all(m.export_layout == 'NHWC' for m in features.modules() if isinstance(m, AFTConvTransformer))
    with pytest.raises(ValueError, match="unknown export layout 'NWHC'"), export_layout(model, 'NWHC'):
        pass


def test_channel_first_trace_of_a_feature_extractor_matches_eager():
    """``forward_intermediates`` recorded channel-first (as a segmentation model's encoder is converted) gives every
    feature map of the eager extractor, at a size other than the trace's, to the float32 rounding bound."""
    torch.manual_seed(0)
    features = timm.create_model('aft_conv_test', features_only=True, out_indices=(1, 3)).eval()
    x = _images(3, 96, 80, 2)
    with torch.no_grad(), _quiet(), export_layout(features, 'NCHW'):
        traced = torch.jit.trace(features, _images(2, 64, 64, 0))
    with torch.no_grad():
        got, eager, exact = traced(x), features(x), copy.deepcopy(features).double()(x.double())
    for i, (g, e, r) in enumerate(zip(got, eager, exact)):
        assert g.shape == e.shape
        ref.assert_model_agrees(g, r, e, label=f'feature map {i}')


@pytest.mark.slow
def test_openvino_runs_a_segmentation_model_on_aft_conv():
    """smp's DPT on ``tu-aft_conv_test`` converted by ``convert_openvino`` (its encoder channel-first) gives the eager
    class maps' logits, at a size other than the conversion's, to the float32 rounding bound."""
    smp = pytest.importorskip('segmentation_models_pytorch')
    torch.manual_seed(0)
    net = smp.DPT('tu-aft_conv_test', encoder_weights=None, classes=3, decoder_readout='ignore').eval()
    x = _images(1, 96, 64, 2)
    with _quiet():
        run = deploy.openvino_runner(deploy.convert_openvino(net, _images(1, 64, 64, 0)), 'fp32')
    with torch.no_grad():
        eager, exact = net(x), copy.deepcopy(net).double()(x.double())
    ref.assert_model_agrees(torch.from_numpy(run(x.numpy())), exact, eager, label='DPT on aft_conv_test in OpenVINO')


def _constant_folded(model):
    from openvino.passes import ConstantFolding, Manager

    manager = Manager()
    manager.register_pass(ConstantFolding())
    manager.run_passes(model)
    return model


def _data_ops(graph):
    """The graph's ops on real-valued data that depends on its input (no shape arithmetic, no work on parameters)."""
    reached, frontier = {}, list(graph.get_parameters())
    while frontier:
        op = frontier.pop()
        for output in op.outputs():
            for target in output.get_target_inputs():
                node = target.get_node()
                if node.get_friendly_name() not in reached and node.get_type_name() != 'ShapeOf':
                    reached[node.get_friendly_name()] = node
                    frontier.append(node)
    return [op for op in reached.values() if op.get_output_element_type(0).is_real()
            and op.get_type_name() != 'Result' and op.get_output_partial_shape(0).rank.get_length() > 0]


def test_converted_aft_conv_runs_channel_first_without_layout_changes():
    """What ``convert_openvino`` gives OpenVINO (``export_layout(model, 'NCHW')``): every node from the patch
    embedding to the pooling on a 4-D map with the channels on axis 1 (OpenVINO's blocked layout), no Transpose,
    Split or Concat of data, the linear layers as 1 x 1 convolutions (the head alone a MatMul), N and D from two
    depthwise convolutions per block."""
    model = timm.create_model('aft_conv_test').eval()
    with _quiet():
        ops = _data_ops(deploy.convert_openvino(model, torch.randn(2, 3, 64, 64)))
    types = [op.get_type_name() for op in ops]
    for banned in ('Transpose', 'Split', 'VariadicSplit', 'Concat', 'Gather'):
        assert banned not in types, [op.get_friendly_name() for op in ops if op.get_type_name() == banned]
    assert types.count('MatMul') == 1  # the head
    assert types.count('GroupConvolution') == 2 * len(model.blocks)
    assert types.count('Convolution') == 1 + 6 * len(model.blocks)  # patch embedding; q, k, v, proj, fc1, fc2
    for op in ops:
        if op.get_type_name() in ELEMENT_WISE:
            shape = op.get_output_partial_shape(0)
            assert shape.rank.get_length() == 4, f'{op.get_friendly_name()}: {op.get_type_name()} on {shape}'


def test_compiled_channel_first_graph_reorders_no_map():
    """What OpenVINO's CPU plugin compiles from it (float32, one key per channel, as aft_conv_small and _tiny): no
    Reorder or Transpose of a token map between two nodes, only of the input image and of the (B, C, 1, 1) global
    sums (a per-channel constant broadcast from fewer dimensions once put the gate in planar NCHW with map reorders
    around it)."""
    model = timm.create_model('aft_conv_test', num_heads=64).eval()
    with _quiet():
        converted = deploy.convert_openvino(model, torch.randn(2, 3, 64, 64))
    converted.reshape([2, 3, 64, 64])
    runtime = ov.Core().compile_model(converted, 'CPU', {'INFERENCE_PRECISION_HINT': 'f32'}).get_runtime_model()
    moved = [op for op in runtime.get_ops() if op.get_rt_info()['layerType'].astype(str) in ('Reorder', 'Transpose')]
    assert moved
    for op in moved:
        shape = list(op.get_output_shape(0))
        source = op.input(0).get_source_output().get_node().get_rt_info()['layerType'].astype(str)
        assert source == 'Input' or shape[-2:] == [1, 1], f'{op.get_friendly_name()} moves a map {shape}'


def test_plain_conversion_runs_element_wise_on_token_rows():
    """``openvino.convert_model`` without ``export_layout`` records token rows (as ONNX does): element-wise nodes on
    (B, T, n) rows with n innermost and no size-1 innermost axis (a (B, H, W, C) map is laid out as NCHW, H
    innermost), the sums of N and D from two convolutions rather than one split: one Split per block (q, k, v), no
    Concat."""
    model = timm.create_model('aft_conv_test').eval()
    with _quiet(), torch.no_grad():
        graph = _constant_folded(ov.convert_model(model, example_input=torch.randn(2, 3, 64, 64)))
    ops = graph.get_ops()
    for op in ops:
        sources = {port.get_source_output().get_node().get_type_name() for port in op.inputs()}
        shape = op.get_output_partial_shape(0)
        if op.get_type_name() not in ELEMENT_WISE or sources & {'Convolution', 'GroupConvolution'} \
                or not op.get_output_element_type(0).is_real() or shape.rank.get_length() == 0:
            continue  # the patch embedding's bias is added to its NCHW output; shape arithmetic
        assert shape.rank.get_length() <= 3, f'{op.get_friendly_name()}: {op.get_type_name()} on {shape}'
        assert not shape[-1].is_static or shape[-1].get_length() > 1, f'{op.get_friendly_name()}: innermost {shape}'
    types = [op.get_type_name() for op in ops]
    assert types.count('GroupConvolution') == 2 * len(model.blocks)
    assert types.count('VariadicSplit') + types.count('Split') == len(model.blocks)
    assert 'Concat' not in types or all(
        op.get_output_partial_shape(0).rank.get_length() <= 1 for op in ops if op.get_type_name() == 'Concat')


def _random_batches(size=64, count=2):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(4, 3, size, size, generator=gen).numpy() for _ in range(count)]


def test_onnx_int8_quantizes_linear_layers_and_keeps_window_convolutions_float(tmp_path):
    import onnx

    model = _build('aft_conv_test', 'trained')
    src, dst = tmp_path / 'float.onnx', tmp_path / 'int8.onnx'
    deploy.export_onnx(model, torch.randn(2, 3, 64, 64), src)
    window_convs = deploy.float_convolutions(src)
    assert len(window_convs) == 2 * len(model.blocks)
    deploy.quantize_onnx(src, dst, _random_batches())
    graph = onnx.load(str(dst)).graph
    producers = {out: node.op_type for node in graph.node for out in node.output}
    for node in graph.node:
        fed = [producers.get(name) for name in node.input]
        if node.name in window_convs:
            assert 'DequantizeLinear' not in fed, f'{node.name}: a window convolution was quantized'
        if node.op_type in ('MatMul', 'Gemm'):
            assert fed[0] == 'DequantizeLinear', f'{node.name}: a linear layer was left in float'
        if node.op_type in ('Exp', 'Div', 'Sigmoid'):
            assert 'DequantizeLinear' not in fed, f'{node.name}: {node.op_type} was quantized'
    logits = deploy.onnx_runner(dst)(_images(3, 64, 64, 1).numpy())
    assert logits.shape == (3, 1000) and np.isfinite(logits).all()


def _consumers(op, passing=('Reshape', 'Convert', 'Transpose')):
    """The types of the nodes that use ``op``'s output, through layout-only nodes."""
    found = set()
    for out in op.outputs():
        for port in out.get_target_inputs():
            node = port.get_node()
            found |= _consumers(node) if node.get_type_name() in passing else {node.get_type_name()}
    return found


def test_openvino_int8_quantizes_linear_layers_and_keeps_window_convolutions_float():
    model = _build('aft_conv_test', 'trained')
    with _quiet():
        quantized = deploy.quantize_openvino(deploy.convert_openvino(model, torch.randn(2, 3, 64, 64)),
                                             _random_batches())
    targets = set()
    for op in quantized.get_ops():
        if op.get_type_name() == 'FakeQuantize':
            targets |= _consumers(op)
    assert targets == {'MatMul', 'Convolution'}  # linear layers and the patch embedding; never GroupConvolution
    logits = deploy.openvino_runner(quantized, 'int8')(_images(3, 64, 64, 1).numpy())
    assert logits.shape == (3, 1000) and np.isfinite(logits).all()


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
    """aft_conv_test with random position biases, as a safetensors file."""
    from aft_vision.checkpoints import save_weights

    path = tmp_path_factory.mktemp('export') / 'model.safetensors'
    save_weights(_build('aft_conv_test', 'trained').state_dict(), path)
    return path


def test_export_and_predict_rebuild_an_aft_conv_model_for_img_size(checkpoint):
    """``--img-size`` rebuilds an AFT-conv model for that size (its windows resampled, as ``create_model(...,
    img_size=96)`` and the main job's other sizes do): the same logits as that model, not the 64 px windows."""
    from aft_vision.cli.parser import build_parser
    from aft_vision.cli.predict import model_from_args

    args = build_parser().parse_args(['export', '--model', 'aft_conv_test', '--checkpoint', str(checkpoint),
                                      '--img-size', '96', '--out', 'unused.onnx'])
    model, _ = model_from_args(args)
    assert model.blocks[0].attn.kernel_size == 7  # 5 x 5 given for 64 px, stretched 1.5x
    from safetensors.torch import load_file
    from aft_vision.models.aft_conv import checkpoint_filter_fn

    built = timm.create_model('aft_conv_test', img_size=96, base_img_size=64).eval()  # the pretrained-loading route
    built.load_state_dict(checkpoint_filter_fn(load_file(str(checkpoint)), built))
    x = _images(2, 96, 96, 1)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), built(x))


@pytest.mark.parametrize('fmt,suffix', [('onnx', '.onnx'), ('openvino', '.xml')])
def test_export_writes_a_file_its_runtime_reads_back(fmt, suffix, checkpoint, tmp_path, capsys):
    out = tmp_path / f'model{suffix}'
    assert cli_main(['export', '--model', 'aft_conv_test', '--checkpoint', str(checkpoint), '--format', fmt,
                     '--out', str(out)]) == 0
    assert 'largest logit error' in capsys.readouterr().out
    run = deploy.load_runner(out)
    model = _build('aft_conv_test', 'trained')
    for seed, size in enumerate(_sizes(model)[1], start=5):  # another batch, and another height and width
        got = torch.from_numpy(run(_images(*size, seed).numpy()))
        assert_agrees('aft_conv_test', 'trained', got, size, seed, f'{out.name} at {size}')
    written = [out.name, 'model.bin'] if fmt == 'openvino' else [out.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(written)


def test_export_int8_reports_agreement_on_held_out_images(checkpoint, tmp_path, capsys):
    folder = tmp_path / 'images'
    folder.mkdir()
    gen = np.random.default_rng(0)
    for i in range(10):
        Image.fromarray(gen.integers(0, 256, (72, 80, 3), dtype=np.uint8)).save(folder / f'{i}.png')
    out = tmp_path / 'int8.xml'
    assert cli_main(['export', '--model', 'aft_conv_test', '--checkpoint', str(checkpoint), '--format', 'openvino',
                     '--out', str(out), '--int8', '--calibration', str(folder)]) == 0
    assert 'top-1 agreement with eager' in capsys.readouterr().out.split('on 2 held-out images')[0]
    assert out.is_file() and out.with_suffix('.bin').is_file()


@pytest.mark.parametrize('options,problem', [
    (['--model', 'aft_conv_nope'], 'unknown model'),
    (['--model', 'aft_conv_test', '--img-size', '60'], 'refuses 60 x 60'),
    (['--model', 'aft_conv_test', '--int8'], '--int8 and --calibration go together'),
    (['--model', 'aft_conv_test', '--int8', '--calibration', 'EMPTY'], 'holds 0 images'),
    (['--model', 'aft_conv_test', '--format', 'openvino'], 'as a .xml file'),
])
def test_export_refuses_bad_input_in_one_line_and_writes_nothing(options, problem, tmp_path, capsys):
    (tmp_path / 'empty').mkdir()
    options = [str(tmp_path / 'empty') if option == 'EMPTY' else option for option in options]
    assert cli_main(['export', *options, '--out', str(tmp_path / 'model.onnx')]) == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ['empty']


def test_export_never_overwrites_without_force(checkpoint, tmp_path, capsys):
    out = tmp_path / 'model.onnx'
    out.write_bytes(b'mine')
    args = ['export', '--model', 'aft_conv_test', '--checkpoint', str(checkpoint), '--out', str(out)]
    assert cli_main(args) == 2
    assert 'pass --force' in capsys.readouterr().err and out.read_bytes() == b'mine'
    assert cli_main(args + ['--force']) == 0
    assert out.read_bytes() != b'mine' and sorted(p.name for p in tmp_path.iterdir()) == ['model.onnx']


@pytest.mark.parametrize('runtime,precision', [('openvino', 'bf16'), ('openvino', 'int8'), ('onnxruntime', 'int8')])
def test_bench_times_both_models_in_a_deployment_runtime(runtime, precision, tmp_path):
    assert cli_main(['bench', '--quick', '--runtime', runtime, '--precision', precision,
                     '--out-dir', str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / 'bench.json').read_text())['rows']
    assert (row['runtime'], row['precision']) == (runtime, precision)
    assert row['aft']['infer_img_s'] > 0 and row['deit']['infer_img_s'] > 0


@pytest.mark.parametrize('options', [['--precision', 'int8'], ['--runtime', 'openvino', '--precision', 'fp16']])
def test_bench_refuses_precisions_a_runtime_does_not_run(options, tmp_path, capsys):
    assert cli_main(['bench', '--quick', *options, '--out-dir', str(tmp_path)]) == 2
    assert 'int8' in capsys.readouterr().err

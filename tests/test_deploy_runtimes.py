"""CPU deployment (``aft_vision.deploy``, ``aft-vision export``) in the real toolchains: OpenVINO IRs of the test
models against the float64 bound (``deploy_cases``), the converted graph's layout, the INT8 recipes' scope in NNCF's
and onnxruntime's graphs, ``aft-vision export`` (writes, checks, refuses), bench in both runtimes.
"""
import contextlib
import copy
import functools
import io
import json

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import aft_reference as ref
import aft_vision  # noqa: F401  registers the models
from aft_vision import deploy
from aft_vision.cli import main as cli_main
from aft_vision.models.aft_conv import AFTConvTransformer, export_layout
from deploy_cases import (OPENVINO_CASES, TEST_CASES, assert_agrees, build_case, export_sizes, quiet, random_images,
                          references)

# the deployment toolchains (the test extra): without them this part is skipped
onnx = pytest.importorskip('onnx')
ort = pytest.importorskip('onnxruntime')
pytest.importorskip('onnxscript')  # the dynamo exporter's back end
ov = pytest.importorskip('openvino')
pytest.importorskip('nncf')


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


@functools.lru_cache(maxsize=None)
def converted(case: str):
    """``convert_openvino`` of the case's trained model on its export example, made once for the tests that read it
    (a test that changes the graph changes a ``clone()``)."""
    model = build_case(case, 'trained')
    with quiet():
        return deploy.convert_openvino(model, random_images(*export_sizes(model)[0], 0))


def _sharing_a_conversion(case):
    """The case, its tests run by one pytest-xdist worker (``--dist loadgroup``): they read one ``converted(case)``."""
    return pytest.param(case, marks=pytest.mark.xdist_group(f'converted_{case}'))


LAYOUT_CASES = ('aft_conv_test', 'aft_conv_test_heads')  # converted() of these is read by the layout tests too


@pytest.mark.parametrize('case', [_sharing_a_conversion(case) if case in LAYOUT_CASES else case
                                  for case in list(TEST_CASES) + list(OPENVINO_CASES)])
def test_openvino_ir_matches_eager(case, tmp_path):
    fresh = export_sizes(build_case(case, 'trained'))[1]
    ov.save_model(converted(case), str(tmp_path / 'model.xml'), compress_to_fp16=False)
    run = deploy.load_runner(tmp_path / 'model.xml', 'fp32')
    for seed, size in enumerate(fresh, start=1):
        got = torch.from_numpy(run(random_images(*size, seed).numpy()))
        assert_agrees(case, 'trained', got, size, seed, f'{case} in OpenVINO at {size}')


def test_export_layout_leaves_eager_untouched_and_is_restored():
    """``export_layout`` changes only what a tracer records: eager logits bit for bit, the layout restored on leaving
    (an error included) in every AFT-conv model of a wrapper; an unknown layout is refused by name."""
    model = build_case('aft_conv_test', 'trained')
    features = timm.create_model('aft_conv_test', features_only=True, out_indices=(1, 3)).eval()
    x = random_images(2, 64, 64, 1)
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
    x = random_images(3, 96, 80, 2)
    with torch.no_grad(), quiet(), export_layout(features, 'NCHW'):
        traced = torch.jit.trace(features, random_images(2, 64, 64, 0))
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
    x = random_images(1, 96, 64, 2)
    with quiet():
        run = deploy.openvino_runner(deploy.convert_openvino(net, random_images(1, 64, 64, 0)), 'fp32')
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


@pytest.mark.xdist_group('converted_aft_conv_test')
def test_converted_aft_conv_runs_channel_first_without_layout_changes():
    """What ``convert_openvino`` gives OpenVINO (``export_layout(model, 'NCHW')``): every node from the patch
    embedding to the pooling on a 4-D map with the channels on axis 1 (OpenVINO's blocked layout), no Transpose,
    Split or Concat of data, the linear layers as 1 x 1 convolutions (the head alone a MatMul), N and D from two
    depthwise convolutions per block."""
    model = build_case('aft_conv_test', 'trained')
    ops = _data_ops(converted('aft_conv_test'))
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


@pytest.mark.xdist_group('converted_aft_conv_test_heads')
def test_compiled_channel_first_graph_reorders_no_map():
    """What OpenVINO's CPU plugin compiles from it (float32, one key per channel, as aft_conv_small and _tiny): no
    Reorder or Transpose of a token map between two nodes, only of the input image and of the (B, C, 1, 1) global
    sums (a per-channel constant broadcast from fewer dimensions once put the gate in planar NCHW with map reorders
    around it)."""
    graph = converted('aft_conv_test_heads').clone()
    graph.reshape([2, 3, 64, 64])
    runtime = ov.Core().compile_model(graph, 'CPU', {'INFERENCE_PRECISION_HINT': 'f32'}).get_runtime_model()
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
    Concat. (In 2 of the test model's 4 blocks: every block records the same nodes.)"""
    model = timm.create_model('aft_conv_test', depth=2).eval()
    with quiet(), torch.no_grad():
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

    model = build_case('aft_conv_test', 'trained')
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
    logits = deploy.onnx_runner(dst)(random_images(3, 64, 64, 1).numpy())
    assert logits.shape == (3, 1000) and np.isfinite(logits).all()


def _consumers(op, passing=('Reshape', 'Convert', 'Transpose')):
    """The types of the nodes that use ``op``'s output, through ``passing`` nodes."""
    found = set()
    for out in op.outputs():
        for port in out.get_target_inputs():
            node = port.get_node()
            found |= _consumers(node, passing) if node.get_type_name() in passing else {node.get_type_name()}
    return found


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
    """aft_conv_test with random position biases, as a safetensors file."""
    from aft_vision.checkpoints import save_weights

    path = tmp_path_factory.mktemp('export') / 'model.safetensors'
    save_weights(build_case('aft_conv_test', 'trained').state_dict(), path)
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
    x = random_images(2, 96, 96, 1)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), built(x))


@pytest.mark.parametrize('fmt,suffix', [('onnx', '.onnx'), ('openvino', '.xml')])
def test_export_writes_a_file_its_runtime_reads_back(fmt, suffix, checkpoint, tmp_path, capsys):
    """The written graph agrees with the model at its size and another batch, and refuses another height and width:
    the model rebuilt for that size resamples its windows (``resize_mode='window'``), which a graph cannot follow."""
    out = tmp_path / f'model{suffix}'
    assert cli_main(['export', '--model', 'aft_conv_test', '--checkpoint', str(checkpoint), '--format', fmt,
                     '--out', str(out)]) == 0
    assert '64x64 px only' in capsys.readouterr().out
    run = deploy.load_runner(out)
    model = build_case('aft_conv_test', 'trained')
    (batch, *other_size) = export_sizes(model)[1]
    got = torch.from_numpy(run(random_images(*batch, 5).numpy()))
    assert_agrees('aft_conv_test', 'trained', got, batch, 5, f'{out.name} at {batch}')
    with pytest.raises(Exception, match='(?i)dimension|shape'):  # the runtime's own refusal
        run(random_images(*other_size[0], 6).numpy())
    written = [out.name, 'model.bin'] if fmt == 'openvino' else [out.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(written)


def test_export_of_a_model_that_keeps_its_windows_takes_any_size(tmp_path, capsys):
    """With ``resize_mode='keep'`` the model takes every size with the same parameters: one graph serves them all."""
    model = build_case('aft_conv_test', 'trained')
    model.resize_mode = 'keep'
    try:
        report = deploy.export(model, tmp_path / 'keep.onnx')
    finally:
        model.resize_mode = 'window'
    size = export_sizes(model)[1][1]
    got = torch.from_numpy(deploy.load_runner(tmp_path / 'keep.onnx')(random_images(*size, 7).numpy()))
    assert report['any_size'] and torch.allclose(got, references('aft_conv_test', 'trained', size, 7)[0], atol=1e-4)


@pytest.fixture(scope='module')
def int8_export(checkpoint, tmp_path_factory):
    """``aft-vision export --int8 --format openvino`` of ``checkpoint``, calibrated on 10 random images: its exit code,
    what it printed and the IR it wrote (NNCF quantizes once for the tests of its report and of its graph)."""
    folder = tmp_path_factory.mktemp('int8')
    (folder / 'images').mkdir()
    gen = np.random.default_rng(0)
    for i in range(10):
        Image.fromarray(gen.integers(0, 256, (72, 80, 3), dtype=np.uint8)).save(folder / 'images' / f'{i}.png')
    out, printed = folder / 'int8.xml', io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli_main(['export', '--model', 'aft_conv_test', '--checkpoint', str(checkpoint), '--format', 'openvino',
                         '--out', str(out), '--int8', '--calibration', str(folder / 'images')])
    return code, printed.getvalue(), out


def test_export_int8_reports_agreement_on_held_out_images(int8_export):
    code, printed, out = int8_export
    assert code == 0 and 'top-1 agreement with eager' in printed.split('on 2 held-out images')[0]
    assert out.is_file() and out.with_suffix('.bin').is_file()


def test_openvino_int8_quantizes_linear_layers_and_keeps_window_convolutions_float(int8_export):
    """In the IR ``export --int8`` wrote (NNCF's recipe, ``deploy.quantize_openvino``; saving turns the weights'
    FakeQuantize into int8 constants): the activations' FakeQuantize and the int8 weights feed the linear layers and
    the patch embedding only, never a GroupConvolution."""
    graph = ov.Core().read_model(str(int8_export[2]))
    dequantize = ('Reshape', 'Convert', 'Transpose', 'Subtract', 'Multiply')
    activations, weights = set(), set()
    for op in graph.get_ops():
        if op.get_type_name() == 'FakeQuantize':
            activations |= _consumers(op)
        if op.get_type_name() == 'Constant' and op.get_output_element_type(0).get_type_name() in ('i8', 'u8'):
            weights |= _consumers(op, dequantize)
    assert activations == weights == {'MatMul', 'Convolution'}, (activations, weights)
    logits = deploy.load_runner(int8_export[2], 'int8')(random_images(3, 64, 64, 1).numpy())
    assert logits.shape == (3, 1000) and np.isfinite(logits).all()


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


@pytest.mark.parametrize('runtime,precision', [('openvino', 'bf16'), ('onnxruntime', 'int8')])
def test_bench_times_both_models_in_a_deployment_runtime(runtime, precision, tmp_path):
    """Each runtime and bench's INT8 calibration once: OpenVINO's INT8 model (``write_model`` with calibration, its
    ``int8`` runner) is what ``aft-vision export --int8`` writes and reads back below, NNCF's graph checked above."""
    assert cli_main(['bench', '--quick', '--runtime', runtime, '--precision', precision,
                     '--out-dir', str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / 'bench.json').read_text())['rows']
    assert (row['runtime'], row['precision']) == (runtime, precision)
    assert row['aft']['infer_img_s'] > 0 and row['deit']['infer_img_s'] > 0


@pytest.mark.parametrize('options', [['--precision', 'int8'], ['--runtime', 'openvino', '--precision', 'fp16']])
def test_bench_refuses_precisions_a_runtime_does_not_run(options, tmp_path, capsys):
    assert cli_main(['bench', '--quick', *options, '--out-dir', str(tmp_path)]) == 2
    assert 'int8' in capsys.readouterr().err

"""CPU deployment (``aft_vision/deploy.py``, ``aft-vision export``): OpenVINO and INT8 in the real toolchains.

OpenVINO runs every test model converted the way users convert (``openvino.convert_model(model, example_input=x)``),
saved as an IR, read back and held to ``test_export``'s float32 rounding bound against the float64 model on fresh
inputs. The converted AFT-conv graph is checked for the layout its speed depends on (element-wise nodes on token rows
with the channels innermost, no concatenation or split of the window sums). The INT8 recipes are checked for their
scope in the quantized graphs NNCF and onnxruntime write (linear layers quantized, window convolutions in float), and
``aft-vision export`` for what it writes, prints and refuses.
"""
import json

import numpy as np
import pytest
import torch
from PIL import Image

import timm
import aft_vision  # noqa: F401  registers the aft_* models
from aft_vision import deploy
from aft_vision.cli import main as cli_main
from test_export import TEST_CASES, _build, _images, _quiet, _sizes, assert_agrees

ov = pytest.importorskip('openvino')
pytest.importorskip('nncf')
pytest.importorskip('onnxruntime')

ELEMENT_WISE = ('Add', 'Multiply', 'Divide', 'Subtract', 'Maximum', 'Sigmoid', 'Exp')


@pytest.mark.parametrize('case', list(TEST_CASES))
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


def _constant_folded(model):
    from openvino.passes import ConstantFolding, Manager

    manager = Manager()
    manager.register_pass(ConstantFolding())
    manager.run_passes(model)
    return model


def test_converted_aft_conv_runs_element_wise_on_token_rows():
    """What OpenVINO runs fast: element-wise nodes on (B, T, n) rows with n innermost and no size-1 innermost axis
    (a (B, H, W, C) map is laid out as NCHW, H innermost), the sums of N and D from two convolutions rather than one
    split: one Split per block (q, k, v) and no Concat."""
    model = timm.create_model('aft_conv_test').eval()
    with _quiet():
        graph = _constant_folded(deploy.convert_openvino(model, torch.randn(2, 3, 64, 64)))
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
    from aft_vision._io import save_weights

    path = tmp_path_factory.mktemp('export') / 'model.safetensors'
    save_weights(_build('aft_conv_test', 'trained').state_dict(), path)
    return path


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

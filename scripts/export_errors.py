"""Largest |onnxruntime - eager| of each model's ONNX graph, per exporter, as a Markdown table (issue 26's table).

    python scripts/export_errors.py [MODEL ... | all]   (default: issue 26's models; all: every aft_* model)

Each model (random weights, seed 0, its default input size, batch 2) is exported by the TorchScript-based exporter
(opsets 17 and 18) and by the dynamo exporter, run in onnxruntime's CPU provider on the export input, and compared
with eager PyTorch. A graph onnxruntime refuses reports its error. The tests (tests/test_deploy.py) hold graphs to
a rounding bound on other inputs; this script gives the raw figures.
"""
import contextlib
import io
import sys
import tempfile
import warnings

import onnxruntime as ort
import timm
import torch

import aft_vision  # noqa: F401  registers the aft_* models

MODELS = ['aft_conv_test', 'aft_conv_tiny', 'aft_conv_small_11_h16', 'aft_full_tiny', 'aft_simple_tiny',
          'aft_full_test', 'aft_simple_test', 'deit_tiny_patch16_224']


def max_error(model, x, opset) -> str:
    """The graph's largest deviation from eager on ``x``; ``opset`` None: the dynamo exporter."""
    dynamo = opset is None
    with tempfile.TemporaryDirectory() as folder:
        path = f'{folder}/model.onnx'
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter('ignore')
                torch.onnx.export(model, (x,), path, dynamo=dynamo, **({} if dynamo else {'opset_version': opset}))
            session = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
            out = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
        except Exception as error:  # noqa: BLE001  the point is to report what the runtime says
            return f'refused: {str(error).splitlines()[0][:90]}'
    with torch.no_grad():
        eager = model(x)
    return f'{(out - eager).abs().max().item():.1e} (logits up to {eager.abs().max().item():.2f})'


def main(names):
    if names == ['all']:
        names = timm.list_models('aft_*')
    print('| model | TorchScript exporter, opset 17 | opset 18 | dynamo exporter |')
    print('|---|---|---|---|')
    for name in names:
        torch.manual_seed(0)
        model = timm.create_model(name).eval()
        x = torch.randn(2, 3, *model.pretrained_cfg['input_size'][-2:])
        print(f'| {name} | ' + ' | '.join(max_error(model, x, opset) for opset in (17, 18, None)) + ' |', flush=True)


if __name__ == '__main__':
    main(sys.argv[1:] or MODELS)

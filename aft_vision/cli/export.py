"""``aft-vision export``: a model as ``predict`` takes it, as ONNX or OpenVINO, float32 or INT8 (``deploy.export``)."""
import argparse
import tempfile
from pathlib import Path

from ..deploy import FORMATS, calibration_files, export
from ..hub import warn_random_weights
from ..tasks.classify import write_digits
from .predict import add_model_arguments, model_from_args

HELP = 'write an ONNX file or an OpenVINO IR, float32 or INT8, checked against eager PyTorch'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument('--format', choices=FORMATS, default='onnx',
                        help='onnx (a .onnx file, onnxruntime) or openvino (an IR: .xml and .bin)')
    parser.add_argument('--out', required=True, help='the .onnx or .xml file to write')
    parser.add_argument('--img-size', type=int, default=None,
                        help='input size (default: the data config\'s); AFT-conv is rebuilt for it (resize_mode)')
    parser.add_argument('--int8', action='store_true', help='quantize: needs --calibration')
    parser.add_argument('--calibration', default=None, metavar='DIR',
                        help='INT8: a folder of images (20%% held out to check against), or "digits": the main job\'s '
                             'split, made in a temporary folder, its 359 held-out digits checked with top-1')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--force', action='store_true', help='overwrite --out')


def run(args: argparse.Namespace) -> int:
    if args.int8 != (args.calibration is not None):
        raise ValueError('--int8 and --calibration go together: INT8 is calibrated on your images')
    if args.calibration not in (None, 'digits'):  # a folder without images: refused before the model is built
        calibration_files(args.calibration, args.seed)
    model, weights = model_from_args(args)
    with tempfile.TemporaryDirectory(prefix='aft-digits-') as scratch:  # never the working directory's
        calibration, held_out = args.calibration, None
        if calibration == 'digits':
            root = write_digits(Path(scratch) / 'data')  # the main job's split: the same seed, the same files
            calibration, held_out = root / 'train', root / 'val'
        report = export(model, args.out, args.format, args.img_size, calibration, args.force, args.seed, held_out)
    size = 'x'.join(map(str, report['img_size'])) + (' px and other sizes' if report['any_size'] else ' px only')
    line = (f"wrote {' and '.join(report['files'])} ({report['format']}, {report['precision']}, {size}): "
            f"largest logit error {report['max_abs_error']:.3g} ({report['max_rel_error']:.2g} of the largest logit) "
            'on 3 random images')
    if 'agreement' in report:
        line += f"; top-1 agreement with eager {report['agreement']:.2f}% on {report['held_out']} held-out images"
    if 'int8_top1' in report:
        line += f" (top-1 eager {report['eager_top1']:.2f}%, INT8 {report['int8_top1']:.2f}%)"
    print(line)
    warn_random_weights(args.model, weights)
    return 0

"""``aft-vision export``: a model as an ONNX file or an OpenVINO IR, float32 or INT8, checked against eager PyTorch.

The model comes as ``predict`` takes it (a registered name with ``--checkpoint`` or ``--pretrained``, or an
``hf-hub:`` / ``local-dir:`` source). The file is written into a temporary folder beside its destination, read back
by its runtime and compared with the eager model there; only then is it moved into place, so a failed export leaves
nothing behind. INT8 follows ``deploy.py``'s recipe, calibrated on a folder of the user's images (or scikit-learn's
digits) with the model's timm data config; the images it holds out are what the agreement is measured on.
"""
import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from timm.data import create_transform, resolve_data_config

from . import deploy
from .predict import add_model_arguments, model_from_args

__all__ = ['export', 'calibration_files', 'add_arguments', 'main']

IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg', '.bmp', '.webp', '.tif', '.tiff', '.gif')
MAX_CALIBRATION = 300  # images calibrated on at most (NNCF's default subset)
HELD_OUT = 0.2  # the share of a folder's images kept for the agreement check
FLOAT_RTOL = 1e-3  # a float32 export's largest logit error over the largest logit: rounding is far below


def _image_files(folder: Path) -> List[Path]:
    return sorted(p for p in folder.rglob('*') if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _load(paths: List[Path], transform) -> torch.Tensor:
    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(transform(image.convert('RGB')))
        except (OSError, UnidentifiedImageError) as error:
            raise ValueError(f'--calibration: cannot read {path} ({type(error).__name__}: {error})') from None
    return torch.stack(images)


def calibration_files(source: str, seed: int = 0) -> Tuple[List[Path], List[Path]]:
    """The image files to calibrate on (at most 300) and to hold out for the agreement check.

    Args:
        source: A folder of images (searched recursively; 20% held out, at random but reproducibly), or 'digits':
            scikit-learn's digits as the main job splits them (its training digits calibrate, its 359 held-out
            digits are held out).
        seed: Seed of the folder's split and of the choice of the calibration images.

    Raises:
        ValueError: The folder does not exist or holds fewer than two images.
    """
    gen = torch.Generator().manual_seed(seed)
    if source == 'digits':
        from .train import write_digits

        root = write_digits(Path('outputs/digits/data'))
        calibrate, held_out = _image_files(root / 'train'), _image_files(root / 'val')
    else:
        folder = Path(source)
        if not folder.is_dir():
            raise ValueError(f'--calibration: {source} is not a folder of images (or "digits")')
        files = _image_files(folder)
        if len(files) < 2:
            raise ValueError(f'--calibration: {source} holds {len(files)} images ({", ".join(IMAGE_SUFFIXES)}); '
                             'INT8 needs at least 2: some to calibrate on, some to check against')
        order = torch.randperm(len(files), generator=gen).tolist()
        num_held = max(1, round(len(files) * HELD_OUT))
        held_out, calibrate = [files[i] for i in order[:num_held]], [files[i] for i in order[num_held:]]
    chosen = sorted(torch.randperm(len(calibrate), generator=gen)[:MAX_CALIBRATION].tolist())
    return [calibrate[i] for i in chosen], held_out


def _write(model: torch.nn.Module, example: torch.Tensor, fmt: str, target: Path, calibration: List[np.ndarray]):
    """The model file(s) at ``target`` (an .onnx file, or an .xml with its .bin), INT8 where ``calibration``; ONNX
    files take any batch, and any image size where the model does (AFT-conv)."""
    if fmt == 'onnx':
        dynamic_size = model._fixed_img_size() is None
        float_file = target.with_name('float.onnx') if calibration else target
        deploy.export_onnx(model, example, float_file, dynamic_size)
        if calibration:
            deploy.quantize_onnx(float_file, target, calibration)
            float_file.unlink()
        return
    import openvino as ov

    ov_model = deploy.convert_openvino(model, example)
    if calibration:
        ov_model = deploy.quantize_openvino(ov_model, calibration)
    ov.save_model(ov_model, str(target), compress_to_fp16=False)  # float32 weights, as the model holds them


def _outputs(out: Path, fmt: str) -> List[Path]:
    return [out] if fmt == 'onnx' else [out, out.with_suffix('.bin')]


def export(model: torch.nn.Module, out: os.PathLike, fmt: str = 'onnx', img_size: int = None,
           calibration: str = None, force: bool = False, seed: int = 0) -> Dict:
    """Write ``model`` to ``out`` in ``fmt`` ('onnx' or 'openvino'), float32, or INT8 calibrated on ``calibration``
    (a folder of images or 'digits'), after checking the written file against eager PyTorch.

    Returns:
        What was measured: the float32 check's largest logit error and its ratio to the largest logit, on random
        images of another batch size; for INT8, top-1 agreement with eager on the held-out images (and eager's and
        the INT8 model's top-1 where the images come in class folders).

    Raises:
        ValueError: Unknown format, a size the model refuses, unusable calibration images, or a written model that
            does not match eager PyTorch (nothing is written then).
        FileExistsError: ``out`` (or its .bin) exists and ``force`` is False.
    """
    if fmt not in deploy.FORMATS:
        raise ValueError(f"--format must be one of {', '.join(deploy.FORMATS)}, got {fmt!r}")
    out = Path(out)
    suffix = '.onnx' if fmt == 'onnx' else '.xml'
    if out.suffix.lower() != suffix:
        raise ValueError(f'--out: a {fmt} model is written as a {suffix} file, got {out}')
    for path in _outputs(out, fmt):
        if path.exists() and not force:
            raise FileExistsError(f'--out: {path} exists; pass --force to overwrite it')
    model.eval()
    config = resolve_data_config({'input_size': (3, img_size, img_size)} if img_size else {}, model=model)
    size = config['input_size'][1:]
    torch.manual_seed(seed)
    example = torch.randn(2, 3, *size)
    try:
        with torch.no_grad():
            model(example)
    except (ValueError, RuntimeError, AssertionError) as error:
        raise ValueError(f'--img-size: the model refuses {size[0]} x {size[1]} images ({error})') from None
    report = {'format': fmt, 'precision': 'int8' if calibration else 'fp32', 'img_size': list(size)}
    batches, held_out = [], None
    if calibration:
        calibrate, held_out = calibration_files(calibration, seed)
        transform = create_transform(**config)
        batches = [batch.numpy() for batch in _load(calibrate, transform).split(32)]
        held_out = (_load(held_out, transform), held_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f'.{out.name}.', dir=out.parent))
    try:
        staged = staging / out.name
        _write(model, example, fmt, staged, batches)
        run = deploy.load_runner(staged, 'int8' if calibration else 'fp32')
        report.update(_check(model, run, size, held_out, calibration, seed))
        for src, dst in zip(_outputs(staged, fmt), _outputs(out, fmt)):
            os.replace(src, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report['files'] = [str(path) for path in _outputs(out, fmt)]
    return report


def _check(model: torch.nn.Module, run, size, held_out, calibration, seed: int) -> Dict:
    """Compare the written model with eager: logits on 3 fresh random images, and for INT8 top-1 on the held-out
    (images, files). A non-finite output, or a float32 error above ``FLOAT_RTOL`` of the largest logit, is refused."""
    gen = torch.Generator().manual_seed(seed + 1)
    images = torch.randn(3, 3, *size, generator=gen)
    with torch.no_grad():
        expected = model(images).numpy()
    got = run(images.numpy())
    error = float(np.abs(got - expected).max())
    scale = float(np.abs(expected).max()) or 1.0
    if not np.isfinite(got).all():
        raise ValueError('the written model returns non-finite logits: nothing written')
    report = {'max_abs_error': error, 'max_rel_error': error / scale}
    if held_out is None:
        if error > FLOAT_RTOL * scale:
            raise ValueError(f'the written model differs from eager PyTorch by {error:.3g} (largest logit {scale:.3g}):'
                             ' nothing written')
        return report
    images, files = held_out
    with torch.no_grad():
        eager = torch.cat([model(batch) for batch in images.split(64)]).argmax(-1).numpy()
    quantized = np.concatenate([run(batch.numpy()) for batch in images.split(64)]).argmax(-1)
    report.update(held_out=len(eager), agreement=float((eager == quantized).mean() * 100))
    if calibration == 'digits':  # class folders 0-9: the labels
        labels = np.array([int(path.parent.name) for path in files])
        report.update(eager_top1=float((eager == labels).mean() * 100),
                      int8_top1=float((quantized == labels).mean() * 100))
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument('--format', choices=deploy.FORMATS, default='onnx',
                        help='onnx (a .onnx file, onnxruntime) or openvino (an IR: .xml and .bin)')
    parser.add_argument('--out', required=True, help='the .onnx or .xml file to write')
    parser.add_argument('--img-size', type=int, default=None, help='input size (default: the model\'s data config)')
    parser.add_argument('--int8', action='store_true', help='quantize: needs --calibration')
    parser.add_argument('--calibration', default=None, metavar='DIR',
                        help='INT8: a folder of images (20%% held out to check against), or "digits"')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--force', action='store_true', help='overwrite --out')


def main(args: argparse.Namespace) -> int:
    if args.int8 != (args.calibration is not None):
        raise ValueError('--int8 and --calibration go together: INT8 is calibrated on your images')
    if args.calibration and args.calibration != 'digits':
        calibration_files(args.calibration, args.seed)  # a folder without images: refused before the model is built
    model = model_from_args(args)
    report = export(model, args.out, args.format, args.img_size, args.calibration, args.force, args.seed)
    size = 'x'.join(map(str, report['img_size']))
    line = (f"wrote {' and '.join(report['files'])} ({report['format']}, {report['precision']}, {size} px): "
            f"largest logit error {report['max_abs_error']:.3g} ({report['max_rel_error']:.2g} of the largest logit) "
            'on 3 random images')
    if 'agreement' in report:
        line += f"; top-1 agreement with eager {report['agreement']:.2f}% on {report['held_out']} held-out images"
    if 'int8_top1' in report:
        line += f" (top-1 eager {report['eager_top1']:.2f}%, INT8 {report['int8_top1']:.2f}%)"
    print(line)
    return 0

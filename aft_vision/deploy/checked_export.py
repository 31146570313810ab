"""A model as an ONNX file or an OpenVINO IR, float32 or INT8, checked against eager PyTorch (``aft-vision export``).

The file is written into a temporary folder beside its destination, read back by its runtime and compared with the
eager model there; only then is it moved into place, so a failed export leaves nothing behind. INT8 follows
``runtimes``' recipe, calibrated on a folder of the user's images with the model's timm data config; the images it
holds out are what the agreement is measured on.
"""
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from timm.data import create_transform, resolve_data_config

from . import runtimes

__all__ = ['export', 'calibration_files']

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


def calibration_files(folder: os.PathLike, seed: int = 0,
                      held_out: Optional[os.PathLike] = None) -> Tuple[List[Path], List[Path]]:
    """The image files to calibrate on (at most 300) and to hold out for the agreement check.

    Args:
        folder: A folder of images, searched recursively.
        seed: Seed of the folder's split and of the choice of the calibration images.
        held_out: A folder of images to check against (e.g. the main job's ``val/`` digits); by default 20% of
            ``folder``, at random but reproducibly.

    Raises:
        ValueError: A folder does not exist or holds too few images (two without ``held_out``, else one each).
    """
    gen = torch.Generator().manual_seed(seed)
    files = _folder_images(folder, 1 if held_out else 2)
    if held_out:
        calibrate, checked = files, _folder_images(held_out, 1)
    else:
        order = torch.randperm(len(files), generator=gen).tolist()
        num_held = max(1, round(len(files) * HELD_OUT))
        checked, calibrate = [files[i] for i in order[:num_held]], [files[i] for i in order[num_held:]]
    chosen = sorted(torch.randperm(len(calibrate), generator=gen)[:MAX_CALIBRATION].tolist())
    return [calibrate[i] for i in chosen], checked


def _folder_images(folder: os.PathLike, at_least: int) -> List[Path]:
    if not Path(folder).is_dir():
        raise ValueError(f'--calibration: {folder} is not a folder of images')
    files = _image_files(Path(folder))
    if len(files) < at_least:
        raise ValueError(f'--calibration: {folder} holds {len(files)} images ({", ".join(IMAGE_SUFFIXES)}); '
                         'INT8 needs at least 2: some to calibrate on, some to check against')
    return files


def _write(model: torch.nn.Module, example: torch.Tensor, fmt: str, target: Path, calibration: List[np.ndarray]):
    """The model file(s) at ``target`` (an .onnx file, or an .xml with its .bin), INT8 where ``calibration``; ONNX
    files take any batch, and any image size where the model does (AFT-conv)."""
    if fmt == 'onnx':
        dynamic_size = model._fixed_img_size() is None
        float_file = target.with_name('float.onnx') if calibration else target
        runtimes.export_onnx(model, example, float_file, dynamic_size)
        if calibration:
            runtimes.quantize_onnx(float_file, target, calibration)
            float_file.unlink()
        return
    import openvino as ov

    ov_model = runtimes.convert_openvino(model, example)
    if calibration:
        ov_model = runtimes.quantize_openvino(ov_model, calibration)
    ov.save_model(ov_model, str(target), compress_to_fp16=False)  # float32 weights, as the model holds them


def _outputs(out: Path, fmt: str) -> List[Path]:
    return [out] if fmt == 'onnx' else [out, out.with_suffix('.bin')]


def export(model: torch.nn.Module, out: os.PathLike, fmt: str = 'onnx', img_size: Optional[int] = None,
           calibration: Optional[os.PathLike] = None, force: bool = False, seed: int = 0,
           held_out: Optional[os.PathLike] = None) -> Dict:
    """Write ``model`` to ``out`` in ``fmt`` ('onnx' or 'openvino'), float32, or INT8 calibrated on ``calibration``
    (a folder of images), after checking the written file against eager PyTorch.

    INT8 is checked on ``held_out`` (``calibration_files``); where its images sit in class folders named by class
    index (``0/``, ``1/``, ...), eager's and the INT8 model's top-1 are measured too.

    Returns:
        What was measured: the float32 check's largest logit error and its ratio to the largest logit, on random
        images of another batch size; for INT8, top-1 agreement with eager on the held-out images (and eager's and
        the INT8 model's top-1 where the images come in class folders).

    Raises:
        ValueError: Unknown format, a size the model refuses, unusable calibration images, or a written model that
            does not match eager PyTorch (nothing is written then).
        FileExistsError: ``out`` (or its .bin) exists and ``force`` is False.
    """
    if fmt not in runtimes.FORMATS:
        raise ValueError(f"--format must be one of {', '.join(runtimes.FORMATS)}, got {fmt!r}")
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
    batches, checking = [], None
    if calibration:
        calibrate, checked = calibration_files(calibration, seed, held_out)
        transform = create_transform(**config)
        batches = [batch.numpy() for batch in _load(calibrate, transform).split(32)]
        checking = (_load(checked, transform), checked if held_out else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f'.{out.name}.', dir=out.parent))
    try:
        staged = staging / out.name
        _write(model, example, fmt, staged, batches)
        run = runtimes.load_runner(staged, 'int8' if calibration else 'fp32')
        report.update(_check(model, run, size, checking, seed))
        for src, dst in zip(_outputs(staged, fmt), _outputs(out, fmt)):
            os.replace(src, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report['files'] = [str(path) for path in _outputs(out, fmt)]
    return report


def _check(model: torch.nn.Module, run, size, held_out, seed: int) -> Dict:
    """Compare the written model with eager: logits on 3 fresh random images, and for INT8 top-1 on the held-out
    (images, files of a given held-out folder or None). A non-finite output, or a float32 error above
    ``FLOAT_RTOL`` of the largest logit, is refused."""
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
    if files and all(path.parent.name.isdigit() for path in files):  # class folders named by index: the labels
        labels = np.array([int(path.parent.name) for path in files])
        report.update(eager_top1=float((eager == labels).mean() * 100),
                      int8_top1=float((quantized == labels).mean() * 100))
    return report

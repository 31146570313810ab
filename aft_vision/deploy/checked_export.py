"""``aft-vision export``: a model written as ONNX or an OpenVINO IR, float32 or INT8 (calibrated on the user's
images), read back by its runtime and compared with eager PyTorch in a temporary folder before it is moved into
place, so a failed export leaves nothing (timm's ``onnx_export`` writes the ONNX graph there)."""
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from timm.data import create_transform, resolve_data_config

from ..checkpoints.files import atomic_files
from ..images import read_image
from . import runtimes

__all__ = ['export', 'calibration_files', 'write_model', 'runs_any_size']

IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg', '.bmp', '.webp', '.tif', '.tiff', '.gif')
MAX_CALIBRATION = 300  # images calibrated on at most (NNCF's default subset)
HELD_OUT = 0.2  # the share of a folder's images kept for the agreement check
FLOAT_RTOL = 1e-3  # a float32 export's largest logit error over the largest logit: rounding is far below


def _load(paths: List[Path], transform) -> torch.Tensor:
    try:
        return torch.stack([transform(read_image(path)) for path in paths])
    except (OSError, ValueError) as error:
        raise ValueError(f'--calibration: {error}') from None


def calibration_files(folder: os.PathLike, seed: int = 0,
                      held_out: Optional[os.PathLike] = None) -> Tuple[List[Path], List[Path]]:
    """Images of ``folder`` to calibrate on (at most 300), and to check (``held_out``'s or 20% of ``folder``)."""
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
        raise ValueError(f'--calibration: {folder} is not a folder of images (or "digits")')
    files = sorted(p for p in Path(folder).rglob('*') if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if len(files) < at_least:
        raise ValueError(f'--calibration: {folder} holds {len(files)} images ({", ".join(IMAGE_SUFFIXES)}); '
                         'INT8 needs at least 2: some to calibrate on, some to check against')
    return files


def write_model(model: torch.nn.Module, example: torch.Tensor, fmt: str, target: Path, calibration: List[np.ndarray],
                dynamic_size: bool = True) -> None:
    """``model`` as an .onnx file or an .xml and .bin (a dynamic batch; height and width: ``dynamic_size``, else
    ``example``'s); INT8 where calibrated."""
    if fmt == 'onnx':
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # INT8's float model: never ``target``'s name
            float_file = Path(scratch) / 'float.onnx' if calibration else target
            runtimes.export_onnx(model, example, float_file, dynamic_size)
            if calibration:
                runtimes.quantize_onnx(float_file, target, calibration)
        return
    import openvino as ov

    ov_model = runtimes.convert_openvino(model, example, dynamic_size)
    if calibration:
        ov_model = runtimes.quantize_openvino(ov_model, calibration)
    # float32 weights, as the model holds them; OpenVINO writes only a lower-case .xml (and the .bin of its stem)
    ov.save_model(ov_model, str(target.with_suffix('.xml')), compress_to_fp16=False)
    target.with_suffix('.xml').replace(target)


def runs_any_size(model: torch.nn.Module) -> bool:
    """Whether one graph serves every input size: the model takes any size with the same parameters (AFT-conv with
    ``resize_mode='keep'``), not rebuilt for it (``set_input_size``: windows or patch resampled)."""
    fixed = getattr(model, '_fixed_img_size', lambda: ())()
    return fixed is None and getattr(model, 'resize_mode', 'keep') == 'keep'


def _outputs(out: Path, fmt: str) -> List[Path]:
    return [out] if fmt == 'onnx' else [out, out.with_suffix('.bin')]


def export(model: torch.nn.Module, out: os.PathLike, fmt: str = 'onnx', img_size: Optional[int] = None,
           calibration: Optional[os.PathLike] = None, force: bool = False, seed: int = 0,
           held_out: Optional[os.PathLike] = None) -> Dict:
    """Write ``model`` to ``out`` as ``fmt`` ('onnx', 'openvino'), float32 or INT8 calibrated on the images of
    ``calibration`` (``calibration_files``), once the written file agrees with eager (``_check``: what it returns);
    ValueError for what it refuses, FileExistsError unless ``force``."""
    if fmt not in runtimes.FORMATS:
        raise ValueError(f"--format must be one of {', '.join(runtimes.FORMATS)}, got {fmt!r}")
    out = Path(out)
    if out.suffix.lower() != runtimes.SUFFIXES[fmt]:
        raise ValueError(f'--out: a {fmt} model is written as a {runtimes.SUFFIXES[fmt]} file, got {out}')
    with atomic_files(_outputs(out, fmt), force) as staged:  # none there (or force); all in place once checked or none
        model.eval()
        config = resolve_data_config({'input_size': (3, img_size, img_size)} if img_size else {}, model=model)
        size = config['input_size'][1:]
        example = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(seed))
        try:
            with torch.no_grad():
                model(example)
        except (ValueError, RuntimeError, AssertionError) as error:
            raise ValueError(f'--img-size: the model refuses {size[0]} x {size[1]} images ({error})') from None
        report = {'format': fmt, 'precision': 'int8' if calibration else 'fp32', 'img_size': list(size),
                  'any_size': runs_any_size(model)}
        batches, checking = [], None
        if calibration:
            calibrate, checked = calibration_files(calibration, seed, held_out)
            transform = create_transform(**config)
            batches = [batch.numpy() for batch in _load(calibrate, transform).split(32)]
            checking = (_load(checked, transform), checked if held_out else None)
        write_model(model, example, fmt, staged[0], batches, report['any_size'])
        run = runtimes.load_runner(staged[0], 'int8' if calibration else 'fp32')
        report.update(_check(model, run, size, checking, seed))
    report['files'] = [str(path) for path in _outputs(out, fmt)]
    return report


def _check(model: torch.nn.Module, run, size, held_out, seed: int) -> Dict:
    """The largest logit error on 3 fresh random images (float32: within ``FLOAT_RTOL`` of the largest logit); INT8:
    top-1 agreement on ``held_out`` (images, files), both top-1s where the files sit in folders named by class index."""
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

"""Safe weight files: read only safetensors or tensor-only pickles, write atomically, never clobber silently."""
import argparse
import contextlib
import hashlib
import os
import pickle
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, Iterator, Mapping, Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

__all__ = ['load_weights', 'save_weights', 'atomic_dir', 'save_figure', 'sha256sum']

PathLike = Union[str, os.PathLike]


def load_weights(path: PathLike) -> Dict[str, torch.Tensor]:
    """Read a weight file: ``.safetensors``, or a PyTorch file through ``torch.load(weights_only=True)``.

    Besides tensors and containers, the weights-only unpickler admits ``argparse.Namespace`` (a plain attribute bag),
    which timm's ``train.py`` stores as ``args`` in its checkpoints; anything else pickled is refused.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The file is truncated, corrupted, empty, or a pickle holding more than tensors.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f'weight file not found: {path}')
    if path.stat().st_size == 0:
        raise ValueError(f'weight file is empty: {path}')
    if path.suffix == '.safetensors':
        try:
            return load_file(str(path), device='cpu')
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(f'{path} is not a readable safetensors file ({error})') from None
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):  # the arguments in timm train.py checkpoints
            checkpoint = torch.load(path, map_location='cpu', weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError, UnicodeDecodeError) as error:
        # the refused global, as torch names it ('Unsupported global: GLOBAL x', 'unsupported GLOBAL x', ...)
        found = re.search(r'unsupported (?:global\w*:? )+([\w.]*\w)', str(error), re.IGNORECASE)
        if found:
            raise ValueError(f'refused to load {path}: it holds pickled objects other than tensors ({found.group(1)}); '
                             'only safetensors or weights-only PyTorch files are read') from None
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f'{path} is truncated or corrupted and cannot be read as a PyTorch file ({detail})') from None
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f'{path} holds a {type(checkpoint).__name__}, not a state dict')
    return dict(checkpoint)


@contextlib.contextmanager
def _staged(target: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of ``target``; move it into place on success, delete it on any failure."""
    if target.exists() and not force:
        raise FileExistsError(f'{target} exists; pass force=True (--force) to overwrite it')
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f'.{target.name}.', dir=target.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def save_weights(state_dict: Mapping[str, torch.Tensor], path: PathLike, force: bool = False,
                 metadata: Optional[Mapping[str, str]] = None) -> str:
    """Write ``state_dict`` as safetensors to ``path`` atomically and return its sha256.

    Raises:
        FileExistsError: ``path`` exists and ``force`` is False.
    """
    path = Path(path)
    with _staged(path, force) as staging:
        temp_file = staging / path.name
        tensors = {key: value.detach().contiguous().cpu() for key, value in state_dict.items()}
        save_file(tensors, str(temp_file), metadata=dict(metadata or {}))
        digest = sha256sum(temp_file)
        os.replace(temp_file, path)
        shutil.rmtree(staging, ignore_errors=True)
    return digest


@contextlib.contextmanager
def atomic_dir(path: PathLike, force: bool = False) -> Iterator[Path]:
    """Build a folder in a temporary sibling; it replaces ``path`` only if the block succeeds."""
    path = Path(path)
    with _staged(path, force) as staging:
        yield staging
        if path.exists():
            retired = path.with_name(f'.{path.name}.old')
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(path, retired)
            os.replace(staging, path)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, path)


def sha256sum(path: PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, 'rb') as handle:
        for block in iter(lambda: handle.read(1 << 20), b''):
            digest.update(block)
    return digest.hexdigest()


def save_figure(fig, path: PathLike, dpi: int = 110) -> None:
    """Save a matplotlib figure as PNG through a temporary sibling, then close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    temp = path.with_name(f'.{path.name}.tmp.png')
    try:
        fig.tight_layout()
        fig.savefig(temp, dpi=dpi)
        os.replace(temp, path)
    finally:
        plt.close(fig)
        temp.unlink(missing_ok=True)

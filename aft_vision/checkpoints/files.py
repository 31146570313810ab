"""Safe weight files and outputs: read only safetensors or tensor-only pickles; write through a temporary sibling and
swap it in, never clobbering silently; ``--force`` replaces only the entries a command writes; modes follow the
user's umask. (timm's ``load_state_dict`` reads any pickle and its savers write in place.)"""
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
from typing import Dict, Iterator, Mapping, Optional, Sequence, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


__all__ = ['load_weights', 'save_weights', 'atomic_file', 'atomic_dir', 'output_dir', 'check_output_dir', 'swap_in',
           'sha256sum', 'umask_mode']

PathLike = Union[str, os.PathLike]


def load_weights(path: PathLike) -> Dict[str, torch.Tensor]:
    """Read safetensors or a weights-only PyTorch file (and timm ``train.py``'s ``args``); ValueError if damaged."""
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


def umask_mode(mode: int = 0o777) -> int:
    """``mode`` less the process umask (``tempfile`` gives 0700 / 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def _temporary_dir(target: Path, kind: str = '') -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f'.{target.name}.{kind}', dir=target.parent))
    folder.chmod(umask_mode())
    return folder


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def _staged(target: Path, force: bool) -> Iterator[Path]:
    if target.exists() and not force and not (target.is_dir() and not any(target.iterdir())):
        raise FileExistsError(f'{target} exists; pass force=True (--force) to overwrite it')
    staging = _temporary_dir(target)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def save_weights(state_dict: Mapping[str, torch.Tensor], path: PathLike, force: bool = False,
                 metadata: Optional[Mapping[str, str]] = None) -> str:
    """Write ``state_dict`` as safetensors to ``path`` atomically (FileExistsError unless ``force``); its sha256."""
    path = Path(path)
    with _staged(path, force) as staging:
        temp_file = staging / path.name
        tensors = {key: value.detach().contiguous().cpu() for key, value in state_dict.items()}
        save_file(tensors, str(temp_file), metadata=dict(metadata or {}))
        temp_file.chmod(umask_mode(0o666))  # safetensors writes 0600
        digest = sha256sum(temp_file)
        os.replace(temp_file, path)
        shutil.rmtree(staging, ignore_errors=True)
    return digest


@contextlib.contextmanager
def atomic_file(path: PathLike, force: bool = False) -> Iterator[Path]:
    """A temporary sibling path to write; it replaces ``path`` (mode from the umask) if the block succeeds, and is
    removed if it fails. FileExistsError if ``path`` exists, unless ``force``."""
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f'{path} exists; pass force=True (--force) to overwrite it')
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f'.{path.name}.', suffix=path.suffix, dir=path.parent)
    os.close(handle)
    temp = Path(temp)
    try:
        yield temp
        temp.chmod(umask_mode(0o666))  # mkstemp makes 0600
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: PathLike, force: bool = False) -> Iterator[Path]:
    """A temporary sibling whose entries reach ``path`` if the block succeeds (``force``: through ``swap_in``)."""
    path = Path(path)
    with _staged(path, force) as staging:
        yield staging
        if path.is_dir():
            swap_in(staging, path)
        else:
            if path.exists():
                path.unlink()
            os.replace(staging, path)


def swap_in(staging: Path, target: Path) -> None:
    """Move ``staging``'s entries into ``target``: all, or (a move failed) none, the replaced ones put back."""
    retired = _temporary_dir(target, 'old.')
    moved = []
    try:
        for entry in sorted(staging.iterdir()):
            if (target / entry.name).exists() or (target / entry.name).is_symlink():
                os.replace(target / entry.name, retired / entry.name)
            moved.append(entry.name)
            os.replace(entry, target / entry.name)
    except BaseException:
        for name in reversed(moved):
            if not (staging / name).exists():  # the new entry had moved in: take it out again
                _remove(target / name)
            _put_back(retired, target, name)
        raise
    finally:
        shutil.rmtree(retired, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)


def _put_back(retired: Path, target: Path, name: str) -> None:
    if (retired / name).exists() or (retired / name).is_symlink():
        os.replace(retired / name, target / name)


def check_output_dir(path: PathLike, force: bool = False, resumes: bool = False) -> None:
    """Raise unless a command may write the folder ``path``: no file, empty unless ``force`` / ``resumes``, writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f'--out-dir: {path} is a file, not a folder')
    if path.is_dir() and not (force or resumes) and any(path.iterdir()):
        raise FileExistsError(f'--out-dir: {path} exists; pass --force to replace what this command writes there')
    existing = next(folder for folder in [path, *path.absolute().parents] if folder.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f'--out-dir: cannot write {path} ({existing} is not a writable folder)')


@contextlib.contextmanager
def output_dir(path: PathLike, force: bool = False, writes: Sequence[str] = (), active: bool = True
               ) -> Iterator[Path]:
    """``path`` for a job to write into (``check_output_dir``), the entries ``writes`` names set aside: dropped on
    success, put back on failure (a folder it made removed). ``active`` False (ranks but 0): untouched."""
    path = Path(path)
    if not active:
        yield path
        return
    check_output_dir(path, force)
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    retired = _temporary_dir(path / 'old')  # hidden, outside ``writes``; made here: the folder is writable
    try:
        for name in writes:
            if (path / name).exists() or (path / name).is_symlink():
                os.replace(path / name, retired / name)
        yield path
    except BaseException:
        if created:
            shutil.rmtree(path, ignore_errors=True)
        else:
            for name in writes:
                _remove(path / name)
                _put_back(retired, path, name)
        raise
    finally:
        shutil.rmtree(retired, ignore_errors=True)


def sha256sum(path: PathLike) -> str:
    """Hex sha256 of a file."""
    with open(path, 'rb') as handle:
        return hashlib.file_digest(handle, 'sha256').hexdigest()

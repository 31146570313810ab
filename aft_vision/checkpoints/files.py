"""Safe weight files and outputs: read only safetensors or tensor-only pickles; write through a temporary sibling and
swap it in, never clobbering silently; ``--force`` replaces only the entries a command writes; modes follow the
user's umask."""
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

from ..plots import save_figure  # noqa: F401  moved to aft_vision.plots: here until tasks and bench import it there

__all__ = ['load_weights', 'save_weights', 'atomic_dir', 'output_dir', 'check_output_dir', 'swap_in', 'save_figure',
           'sha256sum', 'umask_mode']

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


def umask_mode(mode: int = 0o777) -> int:
    """``mode`` less the process umask: what ``mkdir`` or ``open`` would give (``tempfile`` gives 0700 / 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def _temporary_dir(target: Path, kind: str = '') -> Path:
    """An empty hidden sibling of ``target``, mode as the umask gives (it may become ``target`` itself)."""
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
    """Yield a temporary sibling of ``target``; move it into place on success, delete it on any failure."""
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
    """Write ``state_dict`` as safetensors to ``path`` atomically and return its sha256.

    Raises:
        FileExistsError: ``path`` exists and ``force`` is False.
    """
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
def atomic_dir(path: PathLike, force: bool = False) -> Iterator[Path]:
    """Build a folder's entries in a temporary sibling; they reach ``path`` only if the block succeeds.

    An existing ``path`` (``force``) keeps every entry the block did not write: each one it wrote replaces the entry
    of that name (``swap_in``), so a folder the user keeps more in loses nothing but what the command writes.
    """
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
    """Move every entry of the folder ``staging`` into the folder ``target``, then remove ``staging``.

    The entries they replace are set aside until all have moved and put back if a move fails, so ``target`` ends
    either fully updated or as it was. Entries of ``target`` that ``staging`` lacks are left alone.
    """
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
    """Move the entry ``name`` set aside in ``retired`` back into ``target``, where there is one."""
    if (retired / name).exists() or (retired / name).is_symlink():
        os.replace(retired / name, target / name)


def check_output_dir(path: PathLike, force: bool = False, resumes: bool = False) -> None:
    """Raise unless a command may write the folder ``path``: not a file; empty or absent unless ``force`` (or
    ``resumes``: the command continues what is there); in a place the user can write. Touches nothing.

    Raises:
        NotADirectoryError, FileExistsError, PermissionError: as one line naming ``path``.
    """
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
    """The folder a job writes into, ``path`` itself (so what it prints and records names the real place).

    Refused if it exists with anything in it, unless ``force``; made and checked writable before the job starts. The
    entries ``writes`` names that are there already are set aside while the job runs: on success they are dropped
    (``force`` replaces only what the job writes), on failure the job's entries are removed and they are put back, so
    the folder is as it was. A folder the job created is removed again on failure.

    Args:
        writes: The entries (files, folders) the job writes directly under ``path``.
        active: False on processes that only read (ranks other than 0): the folder is yielded untouched.

    Raises:
        FileExistsError: ``path`` holds something and ``force`` is False.
        NotADirectoryError: ``path`` is a file.
        OSError: ``path`` cannot be created or written.
    """
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
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, 'rb') as handle:
        for block in iter(lambda: handle.read(1 << 20), b''):
            digest.update(block)
    return digest.hexdigest()

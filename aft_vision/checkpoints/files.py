"""Safe weight files and outputs: read only safetensors or tensor-only pickles; write through a hidden temporary folder
and swap it in, the output locked from the check to the swap, never clobbering silently; ``--force`` replaces only
the entries a command writes, of their own kind; modes follow the user's umask. (timm's ``load_state_dict`` reads any
pickle and its savers write in place.)"""
import argparse
import contextlib
import hashlib
import os
import pickle
import pickletools
import re
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Union

import filelock
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file


__all__ = ['load_weights', 'save_weights', 'atomic_file', 'atomic_files', 'atomic_dir', 'output_dir', 'check_output',
           'check_output_dir', 'swap_in', 'sha256sum', 'umask_mode', 'WRITTEN']

PathLike = Union[str, os.PathLike]
# globals of a weights-only pickle: torch's tensor rebuilders and storages, and what timm train.py checkpoints hold
_TENSOR_GLOBALS = ('torch.', 'collections.OrderedDict', 'argparse.Namespace', '_codecs.encode')
WRITTEN: List[Path] = []  # the outputs this process put in place whole (what a stopped command says is on disk)


def load_weights(path: PathLike, device: str = 'cpu') -> Dict[str, torch.Tensor]:
    """Read safetensors or a weights-only PyTorch file (and timm ``train.py``'s ``args``); ValueError naming the file
    and what is wrong: damaged, or pickled objects other than tensors (found without running them). ``device='meta'``:
    the tensors' keys, shapes and dtypes alone, no data read (a safetensors header; a PyTorch file's pickle)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f'weight file not found: {path}')
    if path.stat().st_size == 0:
        raise ValueError(f'weight file is empty: {path}')
    with open(path, 'rb') as file:  # safetensors by content too (named .pth): an 8-byte header length, then JSON
        head = file.read(9)
    if path.suffix == '.safetensors' or head[8:] == b'{' and int.from_bytes(head[:8], 'little') < path.stat().st_size:
        try:
            if device != 'meta':
                return load_file(str(path), device=device)
            with safe_open(str(path), 'pt') as file:  # a dtype from an empty slice (a scalar: its one value)
                parts = {key: file.get_slice(key) for key in file.keys()}
                return {key: torch.empty(part.get_shape(), device='meta', dtype=(
                    part[:0] if part.get_shape() else file.get_tensor(key)).dtype) for key, part in parts.items()}
        except (SafetensorError, OSError, ValueError) as error:
            raise ValueError(f'{path} is not a readable safetensors file ({error})') from None
    try:
        with torch.serialization.safe_globals([argparse.Namespace]), warnings.catch_warnings():
            warnings.simplefilter('ignore')  # its note on pickle protocols: the refusal below says what matters
            checkpoint = torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError, UnicodeDecodeError) as error:
        raise ValueError(_refusal(path, error)) from None
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f'{path} holds a {type(checkpoint).__name__}, not a state dict')
    return dict(checkpoint)


def _refusal(path: Path, error: BaseException) -> str:
    """Why torch's weights-only loader refused ``path``, in our words (never its advice to unpickle anyway)."""
    text = str(error)
    found = re.search(r'unsupported (?:global\w*:? )+([\w.]*\w)', text, re.IGNORECASE)  # as torch names it
    objects = [found.group(1)] if found else _pickled_objects(path)
    if objects:
        return (f'refused to load {path}: it holds pickled objects other than tensors ({", ".join(objects[:3])}); '
                'only safetensors or weights-only PyTorch files are read')
    detail = (text.split('WeightsUnpickler error:')[-1].split('Check the documentation')[0].strip().splitlines()
              or [type(error).__name__])[0]
    if objects is not None:  # a whole pickle, of a kind torch's weights-only loader does not read
        return f'{path} is not a weights-only PyTorch file ({detail}); save a state dict of tensors with torch.save'
    return f'{path} is truncated or corrupted and cannot be read as a PyTorch file ({detail})'


def _pickled_objects(path: Path) -> Optional[List[str]]:
    """The globals other than torch's tensor rebuilders that the pickle in ``path`` (or a torch zip's ``data.pkl``)
    would call, read by ``pickletools`` without running anything; None if it is no readable pickle."""
    try:
        data = path.read_bytes()
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                data = archive.read(next(name for name in archive.namelist() if name.endswith('data.pkl')))
        names, strings = [], []
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name == 'GLOBAL':
                names.append(arg.replace(' ', '.'))
            elif isinstance(arg, str):
                strings.append(arg)
            elif opcode.name == 'STACK_GLOBAL' and len(strings) >= 2:
                names.append('.'.join(strings[-2:]))
    except (ValueError, KeyError, StopIteration, OSError, zipfile.BadZipFile, EOFError):
        return None
    return [name for name in dict.fromkeys(names) if not name.startswith(_TENSOR_GLOBALS)]


def umask_mode(mode: int = 0o777) -> int:
    """``mode`` less the process umask (``tempfile`` gives 0700 / 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def _hidden_folder(folder: Path) -> tempfile.TemporaryDirectory:
    # a staging or set-aside folder: hidden, a short random name whatever the output's, in the output's own folder
    return tempfile.TemporaryDirectory(prefix='.aft-', dir=folder, ignore_cleanup_errors=True)


@contextlib.contextmanager
def _guard(path: Path) -> Iterator[None]:
    """``path`` held from the check to the swap against every other writer of it: a lock file beside it (removed while
    still held: a writer that opened it meanwhile tries again), BlockingIOError while another process holds it."""
    where = Path(os.path.abspath(path))  # '..' and 'a/..' named as the folder they are
    where.parent.mkdir(parents=True, exist_ok=True)
    lock_file = where.parent / f'.aft-{hashlib.sha256(os.fsencode(where.name)).hexdigest()[:16]}.lock'
    lock = filelock.FileLock(lock_file, timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise BlockingIOError(f'{path} is being written by another process: wait for it to end, or write elsewhere'
                              ) from None
    try:
        yield
    finally:
        lock_file.unlink(missing_ok=True)
        lock.release()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def check_output(path: PathLike, force: bool = False, folder: bool = False, option: str = '') -> None:
    """Raise (the message after ``option``) unless ``path`` may be written as a file (``folder``: a folder) from a
    writable folder: absent (an empty folder counts so), or, with ``force``, an entry of that kind. A folder is never
    a file's output; a file or a link never a folder's."""
    path = Path(path)
    if folder and (path.is_symlink() or (path.exists() and not path.is_dir())):
        what = f'a link to {os.readlink(path)}' if path.is_symlink() else 'a file'
        raise NotADirectoryError(f'{option}{path} is {what}, not a folder; give the folder itself')
    if not folder and path.is_dir() and not path.is_symlink():
        raise IsADirectoryError(f'{option}{path} is a folder; give the file to write')
    if (path.exists() or path.is_symlink()) and not force and not (folder and not any(path.iterdir())):
        what = 'what this command writes there' if folder else 'it'
        raise FileExistsError(f'{option}{path} exists; pass --force (force=True) to replace {what}')
    existing = next(parent for parent in Path(os.path.abspath(path)).parents if parent.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f'{option}cannot write {path} ({existing} is not a writable folder)')


def _with_umask(folder: Path) -> None:
    # what writers left in a staging folder, given the modes of the user's umask (tempfile and safetensors: 0700 / 0600)
    for entry in [folder, *folder.rglob('*')]:
        if not entry.is_symlink():
            entry.chmod(umask_mode(0o777 if entry.is_dir() else 0o666))


def save_weights(state_dict: Mapping[str, torch.Tensor], path: PathLike, force: bool = False,
                 metadata: Optional[Mapping[str, str]] = None) -> str:
    """Write ``state_dict`` as safetensors to ``path`` atomically (FileExistsError unless ``force``); its sha256."""
    with atomic_file(path, force) as temp:
        save_file({key: value.detach().contiguous().cpu() for key, value in state_dict.items()}, str(temp),
                  metadata=dict(metadata or {}))
        digest = sha256sum(temp)
    return digest


@contextlib.contextmanager
def atomic_files(paths: Sequence[PathLike], force: bool = False, folder: bool = False) -> Iterator[List[Path]]:
    """Temporary paths (in a hidden folder beside them) for files of one folder written together, e.g. an OpenVINO .xml
    and .bin, held against other writers (``_guard``): all replace ``paths`` (``swap_in``, modes from the umask) if
    the block succeeds, none if it fails. ``check_output`` before and again at the swap; ``folder``: one path, a
    folder, whose entries are those of the temporary folder yielded."""
    paths = [Path(path) for path in paths]
    with _guard(paths[0]), _hidden_folder(paths[0].parent) as staging:
        for path in paths:
            check_output(path, force, folder)
        yield Path(staging) if folder else [Path(staging) / path.name for path in paths]
        for path in paths:  # again: a program that takes no lock may have written one meanwhile
            check_output(path, force, folder)
        _with_umask(Path(staging))
        if folder and not paths[0].is_dir():
            os.replace(staging, paths[0])
        else:
            swap_in(Path(staging), *((paths[0], None) if folder else (paths[0].parent, [p.name for p in paths])))
        WRITTEN.extend(paths)


@contextlib.contextmanager
def atomic_file(path: PathLike, force: bool = False) -> Iterator[Path]:
    """``atomic_files`` for one file: the temporary path to write (same name and suffix)."""
    with atomic_files([path], force) as (temp,):
        yield temp


def atomic_dir(path: PathLike, force: bool = False) -> contextlib.AbstractContextManager:
    """``atomic_files`` for a folder: a temporary one whose entries reach ``path`` if the block succeeds."""
    return atomic_files([path], force, folder=True)


def swap_in(staging: Path, target: Path, names: Optional[Sequence[str]] = None) -> None:
    """Move ``staging``'s entries (or those ``names``) into ``target``: all, or (a move failed) none, the replaced
    ones put back; ``staging`` removed."""
    moved = []
    with _hidden_folder(target) as retired:
        retired = Path(retired)
        try:
            for name in names or sorted(entry.name for entry in staging.iterdir()):
                if (target / name).exists() or (target / name).is_symlink():
                    os.replace(target / name, retired / name)
                moved.append(name)
                os.replace(staging / name, target / name)
        except BaseException:
            for name in reversed(moved):
                _put_back(retired, target, name)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _put_back(retired: Path, target: Path, name: str) -> None:
    """``target / name`` as it was: a new entry there taken out, the one set aside in ``retired`` moved back."""
    _remove(target / name)
    if (retired / name).exists() or (retired / name).is_symlink():
        os.replace(retired / name, target / name)


def check_output_dir(path: PathLike, force: bool = False, resumes: bool = False) -> None:
    """``check_output`` of the folder ``path`` (``resumes``: a command that continues what it holds), for --out-dir."""
    check_output(path, force or resumes, folder=True, option='--out-dir: ')


@contextlib.contextmanager
def output_dir(path: PathLike, force: bool = False, writes: Sequence[str] = (), active: bool = True
               ) -> Iterator[Path]:
    """``path`` for a job to write into, held against other writers (``_guard``, ``check_output_dir``), the entries
    ``writes`` names set aside: dropped on success, put back on failure (a folder it made removed). ``active`` False
    (torchrun's ranks but 0, which write nothing there): untouched."""
    path = Path(path)
    if not active:
        yield path
        return
    with _guard(path):
        check_output_dir(path, force)
        created = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        with _hidden_folder(path) as retired:  # outside ``writes``; made here: the folder is writable
            try:
                for name in writes:
                    if (path / name).exists() or (path / name).is_symlink():
                        os.replace(path / name, Path(retired) / name)
                yield path
            except BaseException:
                if created:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    for name in writes:
                        _put_back(Path(retired), path, name)
                WRITTEN[:] = [done for done in WRITTEN if not done.is_relative_to(path)]  # put back, not written
                raise
    WRITTEN.append(path)


def sha256sum(path: PathLike) -> str:
    """Hex sha256 of a file."""
    with open(path, 'rb') as handle:
        return hashlib.file_digest(handle, 'sha256').hexdigest()

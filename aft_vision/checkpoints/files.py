"""Weight files and outputs: what timm's ``load_state_dict`` and savers leave to the caller.

Read: safetensors (its header alone with ``device='meta'``), or ``torch.load(weights_only=True)`` with timm
``train.py``'s ``args`` as timm reads it, but whole (``transfer.select_weights`` takes the weights) and with every
refusal one line naming the file. Write: into a hidden folder beside the output, moved in whole (``swap_in``), the
output locked from its check to the move (one writer per output), never replaced without ``force`` and then only what
the command writes; modes from the user's umask.
"""
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
           'check_output_dir', 'swap_in', 'sha256sum', 'WRITTEN']

PathLike = Union[str, os.PathLike]
# globals of a weights-only pickle: torch's tensor rebuilders and storages, and what timm train.py checkpoints hold
_TENSOR_GLOBALS = ('torch.', 'collections.OrderedDict', 'argparse.Namespace', '_codecs.encode')
WRITTEN: List[Path] = []  # the outputs this process put in place whole (what a stopped command says is on disk)


def load_weights(path: PathLike, device: str = 'cpu') -> Dict[str, torch.Tensor]:
    """The whole checkpoint in ``path``: safetensors (by suffix or content) or a weights-only PyTorch file; ValueError
    naming the file and what is wrong. ``device='meta'``: keys, shapes and dtypes alone, no tensor data read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f'weight file not found: {path}')
    size = path.stat().st_size
    if not size:
        raise ValueError(f'weight file is empty: {path}')
    with open(path, 'rb') as file:  # safetensors: an 8-byte header length, then JSON
        head = file.read(9)
    if path.suffix == '.safetensors' or head[8:] == b'{' and int.from_bytes(head[:8], 'little') < size:
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
    """Why torch refused ``path``, in our words (never its advice to unpickle anyway). torch names the first object
    other than tensors in a file ``torch.save`` wrote, but stops at an opcode it does not take (protocols 0, 4, 5) in
    other pickles: those are read by ``pickletools``, nothing run, for the objects they would call."""
    text, names, strings, ops = str(error), [], [], None
    found = re.findall(r'unsupported (?:global\w*:? )+([\w.]*\w)', text, re.IGNORECASE)
    if not found and not zipfile.is_zipfile(path):
        with contextlib.suppress(ValueError, EOFError, OSError):  # None: no whole pickle
            ops = list(pickletools.genops(path.read_bytes()))
    for opcode, arg, _ in ops or ():
        if opcode.name in ('GLOBAL', 'STACK_GLOBAL'):
            names.append(arg.replace(' ', '.') if arg else '.'.join(strings[-2:]))
        elif isinstance(arg, str):
            strings.append(arg)
    objects = found[:1] or [name for name in dict.fromkeys(names) if not name.startswith(_TENSOR_GLOBALS)]
    if objects:
        return (f'refused to load {path}: it holds pickled objects other than tensors ({", ".join(objects[:3])}); '
                'only safetensors or weights-only PyTorch files are read')
    detail = (text.split('WeightsUnpickler error:')[-1].split('Check the documentation')[0].strip().splitlines()
              or [type(error).__name__])[0]
    if ops is not None:
        return f'{path} is not a weights-only PyTorch file ({detail}); save a state dict of tensors with torch.save'
    return f'{path} is truncated or corrupted and cannot be read as a PyTorch file ({detail})'


def save_weights(state_dict: Mapping[str, torch.Tensor], path: PathLike, force: bool = False,
                 metadata: Optional[Mapping[str, str]] = None) -> str:
    """``state_dict`` as safetensors at ``path`` (``atomic_file``: FileExistsError unless ``force``); its sha256."""
    with atomic_file(path, force) as temp:
        save_file({key: value.detach().contiguous().cpu() for key, value in state_dict.items()}, str(temp),
                  metadata=dict(metadata or {}))
        return sha256sum(temp)


def sha256sum(path: PathLike) -> str:
    """Hex sha256 of a file."""
    with open(path, 'rb') as handle:
        return hashlib.file_digest(handle, 'sha256').hexdigest()


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
    if os.path.lexists(path) and not force and not (folder and not any(path.iterdir())):
        what = 'what this command writes there' if folder else 'it'
        raise FileExistsError(f'{option}{path} exists; pass --force (force=True) to replace {what}')
    existing = next(parent for parent in Path(os.path.abspath(path)).parents if parent.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f'{option}cannot write {path} ({existing} is not a writable folder)')


def check_output_dir(path: PathLike, force: bool = False, resumes: bool = False) -> None:
    """``check_output`` of the folder ``path`` (``resumes``: a command that continues what it holds), for --out-dir."""
    check_output(path, force or resumes, folder=True, option='--out-dir: ')


def _hidden_folder(folder: Path) -> tempfile.TemporaryDirectory:
    # a staging or set-aside folder: hidden, a short random name whatever the output's, in the output's own folder
    return tempfile.TemporaryDirectory(prefix='.aft-', dir=folder, ignore_cleanup_errors=True)


@contextlib.contextmanager
def _guard(path: PathLike) -> Iterator[None]:
    """``path`` held from the check to the swap against every other writer of it: a lock file beside it (removed while
    still held: a writer that opened it meanwhile tries again), BlockingIOError while another process holds it."""
    where = Path(os.path.abspath(path))  # '..' and 'a/..' named as the folder they are
    where.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(where.parent / f'.aft-{hashlib.sha256(os.fsencode(where.name)).hexdigest()[:16]}.lock',
                             timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise BlockingIOError(f'{path} is being written by another process: wait for it to end, or write elsewhere'
                              ) from None
    try:
        yield
    finally:
        Path(lock.lock_file).unlink(missing_ok=True)
        lock.release()


@contextlib.contextmanager
def _replacing(folder: Path, names: Sequence[str]) -> Iterator[None]:
    """``folder``'s entries ``names`` set aside for the block (in a hidden folder there): dropped if it succeeds; if it
    fails, what it left under those names removed and each entry set aside moved back."""
    with _hidden_folder(folder) as retired:
        retired, aside = Path(retired), []
        try:
            for name in names:
                if os.path.lexists(folder / name):
                    os.replace(folder / name, retired / name)
                aside.append(name)
            yield
        except BaseException:
            for name in reversed(aside):
                if (folder / name).is_dir() and not (folder / name).is_symlink():
                    shutil.rmtree(folder / name)
                elif os.path.lexists(folder / name):
                    (folder / name).unlink()
                if os.path.lexists(retired / name):
                    os.replace(retired / name, folder / name)
            raise


def swap_in(staging: Path, target: Path, names: Sequence[str] = ()) -> None:
    """Move ``staging``'s entries (or those ``names``) into ``target``: all, or (a move failed) none, the replaced
    ones put back; ``staging`` removed."""
    names = names or sorted(entry.name for entry in staging.iterdir())
    try:
        with _replacing(target, names):
            for name in names:
                os.replace(staging / name, target / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def atomic_files(paths: Sequence[PathLike], force: bool = False, folder: bool = False) -> Iterator[List[Path]]:
    """Temporary paths (in a hidden folder beside them) for files of one folder written together, e.g. an OpenVINO .xml
    and .bin, held against other writers (``_guard``): all replace ``paths`` (``swap_in``, modes from the umask) if
    the block succeeds, none if it fails. ``check_output`` before and again at the swap; ``folder``: one path, a
    folder, whose entries are those of the temporary folder yielded."""
    paths = [Path(path) for path in paths]
    with _guard(paths[0]), _hidden_folder(paths[0].parent) as staging:
        staging = Path(staging)
        for path in paths:
            check_output(path, force, folder)
        yield staging if folder else [staging / path.name for path in paths]
        probe = staging / '.aft-umask'  # the umask as the kernel applies it to a new file (os.umask would set it)
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o777))
        umask = ~probe.stat().st_mode & 0o777
        probe.unlink()
        for entry in [staging, *staging.rglob('*')]:  # tempfile and safetensors write 0700 / 0600
            if not entry.is_symlink():
                entry.chmod((0o777 if entry.is_dir() else 0o666) & ~umask)
        for path in paths:  # again: a program that takes no lock may have written one meanwhile
            check_output(path, force, folder)
        if folder and not paths[0].is_dir():
            os.replace(staging, paths[0])
        else:
            swap_in(staging, *((paths[0], ()) if folder else (paths[0].parent, [path.name for path in paths])))
        WRITTEN.extend(paths)


@contextlib.contextmanager
def atomic_file(path: PathLike, force: bool = False) -> Iterator[Path]:
    """``atomic_files`` for one file: the temporary path to write (same name and suffix)."""
    with atomic_files([path], force) as (temp,):
        yield temp


def atomic_dir(path: PathLike, force: bool = False) -> contextlib.AbstractContextManager:
    """``atomic_files`` for a folder: a temporary one whose entries reach ``path`` if the block succeeds."""
    return atomic_files([path], force, folder=True)


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
        try:
            with _replacing(path, writes):
                yield path
        except BaseException:
            shutil.rmtree(path, ignore_errors=True) if created else None
            WRITTEN[:] = [done for done in WRITTEN if not done.is_relative_to(path)]  # put back, not written
            raise
    WRITTEN.append(path)

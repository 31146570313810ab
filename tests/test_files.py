"""The one writer (``checkpoints.files.atomic_files`` and what runs on it) and the weight reader's refusals, beside
test_checkpoints.py's weight-file tests: files of one folder land together or not at all, with the user's umask, and a
pickle is called what it is."""
import os
import pickle
import stat

import pytest
import torch
from safetensors.torch import save_file

from aft_vision.checkpoints.files import atomic_dir, atomic_file, atomic_files, load_weights


def test_files_written_together_land_together_or_not_at_all(tmp_path):
    xml, bin_ = tmp_path / 'model.xml', tmp_path / 'model.bin'
    xml.write_text('old xml')
    bin_.write_text('old bin')
    with pytest.raises(FileExistsError, match='--force'):
        with atomic_files([xml, bin_]):
            pass
    with pytest.raises(RuntimeError):  # the writer fails after one file
        with atomic_files([xml, bin_], force=True) as (new_xml, _):
            new_xml.write_text('new xml')
            raise RuntimeError('conversion failed')
    with pytest.raises(OSError):  # the writer never wrote the second file: the first does not land alone
        with atomic_files([xml, bin_], force=True) as (new_xml, _):
            new_xml.write_text('new xml')
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {'model.xml': 'old xml', 'model.bin': 'old bin'}
    with atomic_files([xml, bin_], force=True) as (new_xml, new_bin):
        for path in (new_xml, new_bin, new_xml.with_name('scratch.onnx')):  # a writer's scratch file stays out
            path.write_text(f'new {path.suffix}')
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {'model.xml': 'new .xml', 'model.bin': 'new .bin'}


@pytest.mark.parametrize('umask', [0o022, 0o077, 0o002])
def test_every_writer_gives_the_users_umask_whatever_the_library_wrote(tmp_path, umask):
    old = os.umask(umask)
    try:
        with atomic_file(tmp_path / 'a.safetensors') as temp:
            save_file({'w': torch.zeros(1)}, str(temp))  # safetensors writes 0600
        with atomic_dir(tmp_path / 'folder') as staging:
            save_file({'w': torch.zeros(1)}, str(staging / 'model.safetensors'))
            (staging / 'sub').mkdir(mode=0o700)
    finally:
        os.umask(old)
    for path, mode in ((tmp_path / 'a.safetensors', 0o666), (tmp_path / 'folder', 0o777),
                       (tmp_path / 'folder' / 'model.safetensors', 0o666), (tmp_path / 'folder' / 'sub', 0o777)):
        assert stat.S_IMODE(path.stat().st_mode) == mode & ~umask, path


class _Calls:
    def __reduce__(self):
        return (print, ('never printed',))


@pytest.mark.parametrize('protocol', [0, 1, 2, 3, 4, 5])
def test_a_pickle_is_called_what_it_is_in_every_protocol(protocol, tmp_path, capsys):
    hostile, plain = tmp_path / 'hostile.pkl', tmp_path / 'plain.pkl'
    hostile.write_bytes(pickle.dumps({'w': 1.0, 'x': _Calls()}, protocol=protocol))
    plain.write_bytes(pickle.dumps({'w': 1.0}, protocol=protocol))
    with pytest.raises(ValueError, match=r'pickled objects other than tensors \([\w.]*print\)') as error:
        load_weights(hostile)
    assert 'truncated' not in str(error.value) and 'weights_only' not in str(error.value)
    with pytest.raises(ValueError, match='is not a weights-only PyTorch file') as error:
        load_weights(plain)
    assert 'weights_only' not in str(error.value) and 'never printed' not in capsys.readouterr().out

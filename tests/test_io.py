"""Weight files: only safetensors or tensor-only pickles are read; writes are atomic and never clobber silently."""
import argparse
import collections
import hashlib

import pytest
import torch
from safetensors.torch import load_file

from aft_vision._io import atomic_dir, load_weights, save_weights


@pytest.fixture
def tensors():
    return {'a.weight': torch.randn(3, 4), 'b.bias': torch.arange(5.0)}


def test_safetensors_round_trip_and_sha256(tmp_path, tensors):
    path = tmp_path / 'w.safetensors'
    digest = save_weights(tensors, path)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_weights(path)
    assert loaded.keys() == tensors.keys()
    for key in tensors:
        assert torch.equal(loaded[key], tensors[key])


def test_weights_only_pickle_is_read(tmp_path, tensors):
    path = tmp_path / 'w.pth'
    torch.save({'model': tensors}, path)
    assert torch.equal(load_weights(path)['model']['a.weight'], tensors['a.weight'])


def test_timm_train_checkpoint_with_its_arguments_is_read(tmp_path, tensors):
    path = tmp_path / 'last.pth.tar'  # what timm's train.py saves: weights plus its argparse.Namespace
    torch.save({'epoch': 3, 'arch': 'aft_conv_test', 'state_dict': tensors, 'args': argparse.Namespace(lr=0.1)}, path)
    checkpoint = load_weights(path)
    assert checkpoint['args'].lr == 0.1 and torch.equal(checkpoint['state_dict']['b.bias'], tensors['b.bias'])


def test_refuses_to_overwrite_without_force(tmp_path, tensors):
    path = tmp_path / 'w.safetensors'
    path.write_bytes(b'precious')
    with pytest.raises(FileExistsError, match='--force'):
        save_weights(tensors, path)
    assert path.read_bytes() == b'precious'
    save_weights(tensors, path, force=True)
    assert torch.equal(load_file(str(path))['b.bias'], tensors['b.bias'])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['w.safetensors']  # no temporary left behind


def test_pickle_that_runs_code_is_refused_and_never_run(tmp_path, hostile_pickle):
    path = hostile_pickle(tmp_path / 'bad.pth')  # the fixture fails the test if the code in it ran
    with pytest.raises(ValueError, match=r'pickled objects other than tensors \(\w+\.system\)'):
        load_weights(path)


@pytest.mark.parametrize('make, match', [
    (lambda p: p.write_bytes(b''), 'empty'),
    (lambda p: torch.save(collections.OrderedDict(w=torch.ones(2)), p) or p.write_bytes(p.read_bytes()[:40]),
     'truncated or corrupted'),
    (lambda p: p.write_bytes(b'\x00' * 64), 'truncated or corrupted'),
    (lambda p: torch.save([torch.ones(1)], p), 'not a state dict'),
])
def test_bad_pytorch_files_are_refused(tmp_path, make, match):
    path = tmp_path / 'bad.pth'
    make(path)
    with pytest.raises(ValueError, match=match):
        load_weights(path)


@pytest.mark.parametrize('corrupt', [lambda b: b[:len(b) // 2], lambda b: b'\xff' * 16 + b[16:]])
def test_bad_safetensors_are_refused(tmp_path, tensors, corrupt):
    path = tmp_path / 'w.safetensors'
    save_weights(tensors, path)
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(ValueError, match='not a readable safetensors file'):
        load_weights(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match='nope.safetensors'):
        load_weights(tmp_path / 'nope.safetensors')


def test_atomic_dir_leaves_nothing_on_failure_and_keeps_the_old_folder(tmp_path):
    target = tmp_path / 'out'
    with atomic_dir(target) as staging:
        (staging / 'a.txt').write_text('first')
    with pytest.raises(RuntimeError):
        with atomic_dir(target, force=True) as staging:
            (staging / 'a.txt').write_text('half')
            raise RuntimeError('upload failed')
    assert (target / 'a.txt').read_text() == 'first'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['out']
    with pytest.raises(FileExistsError):
        with atomic_dir(target):
            pass
    with atomic_dir(target, force=True) as staging:
        (staging / 'b.txt').write_text('second')
    assert sorted(p.name for p in target.iterdir()) == ['b.txt']

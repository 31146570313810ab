"""Every entry point that reads weights refuses bad files clearly and leaves nothing behind; CLI errors are one line."""
import os

import pytest
import timm
import torch

import aft_vision  # noqa: F401
from aft_vision._io import save_weights
from aft_vision.cli import main as cli_main


class Exploit:
    def __reduce__(self):
        return (os.system, ('echo pwned',))


def _write_bad(kind, folder):
    """A weight file of the given badness for ``aft_conv_test``."""
    good = timm.create_model('aft_conv_test').state_dict()
    if kind == 'pickled':
        path = folder / 'bad.pth'
        torch.save({'model': good, 'extra': Exploit()}, path)
    elif kind == 'truncated':
        path = folder / 'bad.safetensors'
        save_weights(good, path)
        path.write_bytes(path.read_bytes()[:1000])
    elif kind == 'corrupted':
        path = folder / 'bad.pth'
        torch.save(good, path)
        data = bytearray(path.read_bytes())
        data[100:400] = os.urandom(300)
        path.write_bytes(bytes(data))
    elif kind == 'wrong-architecture':
        path = folder / 'bad.safetensors'
        save_weights(timm.create_model('aft_full_test').state_dict(), path)
    else:  # oversized: a checkpoint of a wider model than the one asked for
        path = folder / 'bad.safetensors'
        save_weights(timm.create_model('aft_conv_test', embed_dim=128, num_heads=8).state_dict(), path)
    return path


KINDS = ['pickled', 'truncated', 'corrupted', 'wrong-architecture', 'oversized']


@pytest.mark.parametrize('kind', KINDS)
def test_create_model_with_a_file_overlay_refuses(kind, tmp_path):
    path = _write_bad(kind, tmp_path)
    with pytest.raises(Exception) as error:
        timm.create_model('aft_conv_test', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    message = str(error.value)
    expected = {'pickled': 'Unsupported global', 'wrong-architecture': 'pos_weight', 'oversized': 'size mismatch'}
    if kind in expected:
        assert expected[kind] in message


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('command', ['transfer', 'publish'])
def test_cli_refuses_bad_weight_files_with_one_line(kind, command, tmp_path, capsys):
    path = _write_bad(kind, tmp_path)
    if command == 'transfer':
        args = ['transfer', '--src', str(path), '--model', 'aft_conv_test', '--out', str(tmp_path / 'o.safetensors')]
    else:
        args = ['publish', str(path), '--model', 'aft_conv_test', '--repo-id', 'me/x', '--dry-run',
                '--out-dir', str(tmp_path / 'folder')]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('aft-vision: error:') and '\n' not in err and 'Traceback' not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no partial output


@pytest.mark.parametrize('args, words', [
    (['transfer', '--src', 'deit_tiny_patch16_224', '--model', 'aft_conv_smal', '--out', 'o.safetensors'],
     'did you mean aft_conv_small'),
    (['transfer', '--src', 'missing.pth', '--model', 'aft_conv_test', '--out', 'o.safetensors'], 'not found'),
    (['transfer', '--src', 'x.pth', '--model', 'aft_conv_test', '--out', 'o.pth'], '.safetensors'),
    (['bench', '--models', 'aft_conv_tinyy', '--resolutions', '64'], 'unknown model'),
    (['demo', '--device', 'nope'], '--device'),
])
def test_cli_user_errors_are_one_line(args, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and '\n' not in err


def test_publish_to_an_unwritable_folder_is_one_line(tmp_path, capsys):
    if os.geteuid() == 0:
        target = '/proc/aft-vision-cannot-write-here'  # root may write anywhere else
    else:
        locked = tmp_path / 'locked'
        locked.mkdir(mode=0o500)
        target = str(locked / 'out')
    checkpoint = tmp_path / 'w.safetensors'
    save_weights(timm.create_model('aft_conv_test').state_dict(), checkpoint)
    args = ['publish', str(checkpoint), '--model', 'aft_conv_test', '--repo-id', 'me/x', '--dry-run',
            '--out-dir', target]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('aft-vision: error:') and '\n' not in err
